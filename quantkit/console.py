"""The terminal chat loop of `quantkit chat` (the local engine) and `quantkit api-client` (a server).

A session answers one message at a time (`answer(text, write)`, streaming through `write`) and forgets
the conversation on `clear()`. The loop reads a line: `exit` or end of input leaves, `clear` starts a new
conversation, anything else is answered. Ctrl-C at the prompt leaves; while an answer streams, the
session stops it. Nothing here imports torch, so the api-client starts at once.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Protocol, TextIO

HELP = "type a message; 'clear' starts a new conversation, 'exit' leaves; Ctrl-C stops an answer"


class ChatSessionLike(Protocol):
    def answer(self, text: str, write: Callable[[str], None]) -> str: ...

    def clear(self) -> None: ...


def chat_loop(session: ChatSessionLike, stdin: TextIO, stdout: TextIO, stderr: Optional[TextIO] = None,
              turn_errors: tuple[type[Exception], ...] = (), interrupt_stops_answer: bool = False) -> None:
    """Converse on the terminal until `exit`, end of input or Ctrl-C at the prompt.

    `turn_errors`: exceptions of `session.answer` that fail only the turn (one `error:` line on `stderr`,
    then the next prompt). `interrupt_stops_answer`: a KeyboardInterrupt out of `answer` ends the answer
    (" [stopped]") instead of the program — for sessions with nothing to leave half-done (a client's
    connection); the engine's session traps Ctrl-C itself and stops between two steps."""
    catch = (KeyboardInterrupt,) if interrupt_stops_answer else ()

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    write(HELP + "\n")
    while True:
        write("\n>>> ")
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            write("\n")
            return
        if not line:  # end of input
            write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text == "exit":
            return
        if text == "clear":
            session.clear()
            write("(new conversation)\n")
            continue
        try:
            session.answer(text, write)
        except turn_errors as exc:
            write("\n")
            err = stderr or sys.stderr
            err.write(f"error: {exc}\n")
            err.flush()
            continue
        except catch:  # a second Ctrl-C before the answer's own handler ran: still one answer
            write(" [stopped]")
        write("\n")
