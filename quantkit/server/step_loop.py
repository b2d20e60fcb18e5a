"""StepLoop: the one loop that steps the engine for the server, in the engine process or in a thread.

Before every step it applies the commands that have arrived (add, abort, stop); it steps back to back
while any request is unfinished and blocks on its inbox only when there is nothing to run. After every
step it emits one message, which is also its heartbeat: the server's watchdog counts the time since the
last one while requests are pending.

Each request's own work is a boundary: a request that cannot be added (a bad image, a template error,
anything) is answered alone ("rejected"); one whose sampling, detokenizing or stop check fails inside
`Engine.step` comes out finished with finish_reason "error" and is answered alone too ("failures").
Only a step that fails as a whole (the forward, a device fault) ends the loop: `run` raises and the host
decides (the engine process exits non-zero and the server restarts it; a thread stops the server).

Messages emitted (tuples, pickled across the engine process's pipe):
    ("outputs", lean rows, [(request_id, error)], stats)   after each step
    ("stats", stats)                                       after commands that needed no step
    ("rejected", request_id, message, user_error)          a request that could not be added
"""

from __future__ import annotations

import abc
import logging
import threading
from collections import deque
from typing import Any, Callable, Optional

from quantkit.config import UserError
from quantkit.server.engine_requests import add_to_engine, lean

log = logging.getLogger(__name__)

def warm_grammars(engine: Any) -> None:
    """Make the engine's grammar compiler before the first request (reading the vocabulary takes 0.3-1 s,
    a stall of every request in flight if the first request with a grammar paid it)."""
    if getattr(engine, "tokenizer", None) is None or not hasattr(type(engine), "grammars"):
        return
    try:
        engine.grammars
    except Exception as exc:   # XGrammar missing, a tokenizer it cannot read: the requests with a grammar fail alone
        log.warning("structured output is not available: %s", exc)


class Inbox(abc.ABC):
    """Where the loop's commands come from."""

    @abc.abstractmethod
    def get(self, block: bool) -> Optional[tuple]:
        """The next command; None when there is none and `block` is False."""


class ThreadInbox(Inbox):
    """Commands from other threads of this process: `put` from any thread."""

    def __init__(self) -> None:
        self._commands: deque = deque()
        self._wake = threading.Event()

    def put(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def get(self, block: bool) -> Optional[tuple]:
        while block and not self._commands:
            self._wake.wait()
            self._wake.clear()                 # before reading: a later put wakes us again
        return self._commands.popleft() if self._commands else None


class PipeInbox(Inbox):
    """Commands from the server's end of a multiprocessing pipe; a closed pipe reads as "stop"."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def get(self, block: bool) -> Optional[tuple]:
        try:
            if block or self.connection.poll():
                return self.connection.recv()
        except (EOFError, OSError):            # the server is gone
            return ("stop",)
        return None


class StepLoop:
    """See the module docstring. `emit` sends one message to the server (from the loop's thread);
    `before_step`, when given, runs before every step (tests inject hangs and failures through it)."""

    def __init__(self, engine: Any, inbox: Inbox, emit: Callable[[tuple], None],
                 before_step: Optional[Callable[[], None]] = None) -> None:
        self.engine, self.inbox, self.emit, self.before_step = engine, inbox, emit, before_step

    def run(self) -> None:
        """Serve commands until "stop" (or the inbox closes). A step that fails as a whole raises."""
        engine = self.engine
        warm_grammars(engine)
        while True:
            command = self.inbox.get(block=not engine.has_unfinished_requests())
            while command is not None:
                if command[0] == "stop":
                    return
                self.apply(command)
                command = self.inbox.get(block=False)
            if not engine.has_unfinished_requests():
                self.emit(("stats", engine.stats()))     # aborts freed blocks without a step
                continue
            if self.before_step is not None:
                self.before_step()
            outputs = engine.step()
            rows = lean([o for o in outputs if o.finish_reason != "error"])
            failures = [(o.request_id, o.error) for o in outputs if o.finish_reason == "error"]
            self.emit(("outputs", rows, failures, engine.stats()))

    def apply(self, command: tuple) -> None:
        kind, request_id = command[0], command[1]
        if kind == "abort":
            self.engine.abort(request_id)
            return
        try:
            add_to_engine(self.engine, request_id, command[2], command[3])
        except Exception as exc:  # this request's alone, whatever it was
            if isinstance(exc, UserError):
                self.emit(("rejected", request_id, str(exc), True))
            else:
                log.exception("request %s could not be added", request_id)
                self.emit(("rejected", request_id, f"the request could not be added: {type(exc).__name__}: "
                           f"{exc}", False))
