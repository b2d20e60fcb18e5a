"""The terminal chat behind `quantkit chat`: streamed answers, a multi-turn history, `exit` and `clear`.

Each turn sends the whole conversation through the chat template; the earlier turns' KV blocks are
found again by the prefix cache, so only the new turn is computed. Ctrl-C while an answer streams stops
that answer (what was printed stays in the history); Ctrl-C at the prompt, or end of input, leaves.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO

from quantkit.console import chat_loop
from quantkit.engine.config import SamplingParams
from quantkit.engine.llm_engine import Engine


class ChatSession:
    """A conversation with an engine: the messages so far and one answer at a time."""

    def __init__(self, engine: Engine, params: SamplingParams, system: Optional[str] = None) -> None:
        self.engine, self.params, self.system = engine, params, system
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, user_text: str, write: Callable[[str], None]) -> str:
        """Stream the answer to `user_text` through `write`; returns it (the part written when Ctrl-C
        stopped it) and keeps both turns in the history."""
        self.messages.append({"role": "user", "content": user_text})
        parts: list[str] = []
        stop = threading.Event()
        with _sigint_sets(stop):
            stream = self.engine.stream(self.messages, self.params)
            for out in stream:
                parts.append(out.text)
                write(out.text)
                if stop.is_set():
                    stream.close()  # aborts the request: its blocks are freed now
                    write(" [stopped]")
                    break
        text = "".join(parts)
        self.messages.append({"role": "assistant", "content": text})
        return text


@contextmanager
def _sigint_sets(event: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C sets `event` instead of raising: the answer stops between two steps, never
    in the middle of one (the scheduler's state stays whole)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(engine: Engine, params: SamplingParams, system: Optional[str] = None,
             stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """Read messages from `stdin` until `exit` (or end of input), answering each on `stdout`."""
    chat_loop(ChatSession(engine, params, system), stdin, stdout)


def chat(model: str, config, params: SamplingParams, system: Optional[str] = None) -> None:
    """`quantkit chat`: an engine over `model`, then the conversation on the terminal."""
    run_chat(Engine(model, config), params, system)
