"""The terminal chat behind `quantkit chat`: streamed answers, a multi-turn history, `exit` and `clear`.

Each turn sends the whole conversation through the chat template; the earlier turns' KV blocks are
found again by the prefix cache, so only the new turn is computed. When the conversation outgrows the
context, its oldest exchanges (a user turn and its answer) are dropped, the system prompt kept, until the
prompt and room for an answer fit; a message that cannot fit even alone fails only its turn. Ctrl-C while
an answer streams stops that answer (what was printed stays in the history); Ctrl-C at the prompt, or end
of input, leaves.

Sampling: the user's flags, else the model's generation_config, else — when the checkpoint sets no
sampling at all — conservative chat defaults (temperature 0.7, top-p 0.9): plain temperature-1 sampling
over the whole vocabulary makes small chat models ramble. The server keeps OpenAI's defaults instead.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TextIO

from quantkit.config import UserError
from quantkit.console import chat_loop
from quantkit.engine.config import SamplingParams
from quantkit.engine.llm_engine import Engine, encode_chat

CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9}   # when the model's generation config sets no sampling
MODEL_SAMPLING = ("do_sample", "temperature", "top_p", "top_k")   # generation config fields that do


class ContextFull(UserError):
    """The newest message, with the system prompt and room for an answer, exceeds the context."""


def _setting(generation_config: Any, name: str) -> Any:
    if isinstance(generation_config, dict):
        return generation_config.get(name)
    return getattr(generation_config, name, None)


def chat_sampling(params: SamplingParams, generation_config: Any) -> tuple[SamplingParams, str]:
    """`params` with the chat defaults filled in where neither they nor the model set sampling, and where
    the unset settings come from (for the line `describe` prints)."""
    if any(_setting(generation_config, name) is not None for name in MODEL_SAMPLING):
        return params, "the model's generation_config"
    filled = {k: v for k, v in CHAT_SAMPLING.items() if getattr(params, k) is None}
    return dataclasses.replace(params, **filled), "quantkit chat's defaults, as the model sets none"


def describe(resolved: SamplingParams, given: SamplingParams, source: str) -> str:
    """One line: the sampling in effect and where it comes from."""
    p = resolved
    if p.temperature == 0:
        text = "greedy"
    else:
        text = f"temperature {p.temperature:g}, top-p {p.top_p:g}, top-k {p.top_k or 'off'}"
        if p.min_p:
            text += f", min-p {p.min_p:g}"
    if p.repetition_penalty != 1:
        text += f", repetition penalty {p.repetition_penalty:g}"
    flags = [f"--{k.replace('_', '-')}" for k in ("temperature", "top_p", "top_k") if getattr(given, k) is not None]
    origin = source if not flags else (" ".join(flags) if len(flags) == 3 else f"{' '.join(flags)}, else {source}")
    return f"sampling: {text}; at most {p.max_tokens} new tokens ({origin})"


class ChatSession:
    """A conversation with an engine: the messages so far and one answer at a time."""

    def __init__(self, engine: Engine, params: SamplingParams, system: Optional[str] = None) -> None:
        self.engine, self.system = engine, system
        self.params, source = chat_sampling(params, engine.generation_config)
        eos = getattr(engine.tokenizer, "eos_token_id", None)
        self.resolved = self.params.with_defaults(engine.generation_config, eos)  # what the engine will use
        self.sampling = describe(self.resolved, params, source)
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """(messages, their prompt token ids, exchanges dropped): the oldest user+assistant pairs after the
        system prompt dropped until the prompt leaves room for an answer (--max-new-tokens, at most half the
        context). ContextFull when the newest message cannot fit even alone."""
        limit = self.engine.scheduler.max_model_len
        room = min(self.resolved.max_tokens, limit // 2)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        messages, dropped = list(messages), 0
        while True:
            ids = encode_chat(self.engine.tokenizer, messages)
            if len(ids) + room <= limit:
                return messages, ids, dropped
            if len(messages) - first <= 1:
                raise ContextFull(f"this message does not fit the context of {limit} tokens: the prompt would be "
                                  f"{len(ids)} tokens{' with the system prompt' if first else ''}, and {room} are "
                                  f"kept for the answer: shorten it, or lower --max-new-tokens")
            del messages[first:first + 2]
            dropped += 1

    def answer(self, user_text: str, write: Callable[[str], None]) -> str:
        """Stream the answer to `user_text` through `write`; returns it (the part written when Ctrl-C
        stopped it) and keeps both turns in the history. ContextFull (the history unchanged) when the
        message cannot fit."""
        messages, ids, dropped = self.fit(self.messages + [{"role": "user", "content": user_text}])
        if dropped:
            write(f"(the conversation outgrew the context of {self.engine.scheduler.max_model_len} tokens: "
                  f"its oldest {dropped} exchange{'s' if dropped > 1 else ''} dropped)\n")
        parts: list[str] = []
        stop = threading.Event()
        # Token ids as counted; a vision model's processor encodes the messages itself.
        prompt = ids if getattr(self.engine, "vision", None) is None else messages
        with _sigint_sets(stop):
            stream = self.engine.stream(prompt, self.params)
            for out in stream:
                parts.append(out.text)
                write(out.text)
                if stop.is_set():
                    stream.close()  # aborts the request: its blocks are freed now
                    write(" [stopped]")
                    break
        text = "".join(parts)
        self.messages = messages + [{"role": "assistant", "content": text}]
        return text


@contextmanager
def _sigint_sets(event: threading.Event) -> Iterator[None]:
    """While inside, Ctrl-C sets `event` instead of raising: the answer stops between two steps, never
    in the middle of one (the scheduler's state stays whole). A process that ignores SIGINT (started in
    the background) keeps ignoring it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    current = signal.getsignal(signal.SIGINT)
    if current in (signal.SIG_IGN, None):   # ignored, or a handler Python did not install
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(engine: Engine, params: SamplingParams, system: Optional[str] = None, stdin: Optional[TextIO] = None,
             stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> None:
    """Print the sampling in effect, then read messages from `stdin` until `exit` (or end of input),
    answering each on `stdout`; a turn the engine refuses (a message too long for the context) prints one
    `error:` line on `stderr` and the chat goes on. (Defaults: the sys streams of the moment of the call.)"""
    session = ChatSession(engine, params, system)
    stdout = stdout or sys.stdout
    stdout.write(session.sampling + "\n")
    chat_loop(session, stdin or sys.stdin, stdout, stderr or sys.stderr, turn_errors=(UserError,))


def chat(model: str, config, params: SamplingParams, system: Optional[str] = None) -> None:
    """`quantkit chat`: an engine over `model`, then the conversation on the terminal."""
    params.validate()  # before the weights load
    run_chat(Engine(model, config), params, system)
