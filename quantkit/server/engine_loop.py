"""The one loop that steps the engine for every HTTP request, and what the app knows of the engine.

The app talks to a backend through `EngineClient`: `add` a request (prompt tokenized, params resolved)
with a sink for its outputs, `abort` one, read `stats()`. Outputs reach the sinks on the event loop's
thread, one `call_soon_threadsafe` per engine step. Two backends:

- `EngineLoop` (here): the engine in a thread of this process. The engine is not thread-safe, so only
  that thread touches it; commands go through a deque, applied between steps; steps run back to back
  while any request is unfinished; with nothing to do the thread sleeps on an Event.
- `EngineProcess` (engine_process.py): the engine in a process of its own, what `quantkit serve` runs.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections import deque
from typing import Any, Callable, Optional, Union

from quantkit.config import UserError
from quantkit.server.engine_requests import (  # noqa: F401  (re-exported)
    ChatWithImages, EngineFailure, EngineInfo, Sink, StepOutput, add_to_engine, lean)

log = logging.getLogger(__name__)


class EngineClient(abc.ABC):
    """The event loop's side of a backend: the sinks of the requests in flight and their delivery. A backend
    (EngineLoop: a thread; EngineProcess: a process) says how commands reach its engine and how it is doing."""

    info: EngineInfo

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}            # event-loop thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[str] = None             # set once the engine failed: the server reports unhealthy

    @abc.abstractmethod
    def _send(self, command: tuple) -> None:
        """Deliver one command (add, abort, stop) to the engine's side."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """The engine's counters (Engine.stats) as last known."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the engine's side still runs."""

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (as the event loop has seen them)."""
        return len(self._sinks)

    def add(self, request_id: str, prompt: Union[list[int], ChatWithImages], params: Any, sink: Sink) -> None:
        """Queue a request (token ids, or a chat with images; params resolved); its outputs go to `sink`."""
        self._sinks[request_id] = sink
        self._send(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        """Stop a request (a client left); its KV blocks are freed before the next step."""
        if self._sinks.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def _deliver_lean(self, rows: list[tuple]) -> None:
        self._deliver([(row[0], StepOutput(*row[1:])) for row in rows])

    def _deliver(self, outputs: list) -> None:
        for rid, out in outputs:
            sink = self._sinks.get(rid)
            if sink is None:
                continue                               # aborted meanwhile
            if out.finished:
                del self._sinks[rid]
            sink(out)

    def _fail_in_flight(self, message: str) -> None:
        self._deliver([(rid, EngineFailure(message, False)) for rid in list(self._sinks)])

    def _post(self, items: list[tuple[str, Union[Any, EngineFailure]]]) -> None:
        """Deliver on the event loop's thread (from any thread)."""
        self._call(self._deliver, items)

    def _post_lean(self, rows: list[tuple]) -> None:
        self._call(self._deliver_lean, rows)

    def _call(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed between the check and the call (shutdown)
                pass


class EngineLoop(EngineClient):
    """The engine stepped by a thread of this process (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._active: set[str] = set()               # engine thread only: requests added, not finished
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.steps = 0

    def start(self) -> None:
        """Start the thread; call from the event loop that will receive the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stats(self) -> dict:
        return self.engine.stats()

    def _send(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    async def stop(self) -> None:
        """Abort whatever is left and end the thread."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # --- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            # After a failed step the engine's state is not trusted: it is never stepped again.
            if not self._commands and (self.error is not None or not engine.has_unfinished_requests()):
                if self._stopping:
                    return
                self._wake.wait()
                self._wake.clear()                     # before reading the commands: a later add wakes us again
            self._apply_commands()
            if self.error is not None or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug or a device fault: fail every request, keep serving errors
                log.exception("engine step failed")
                self.error = f"{type(exc).__name__}: {exc}"
                self._fail_all(f"the engine failed: {self.error}")
                continue
            self.steps += 1
            if outputs:
                for out in outputs:
                    if out.finished:
                        self._active.discard(out.request_id)
                self._post_lean(lean(outputs))

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            rid = command[1]
            if command[0] == "abort":
                self.engine.abort(rid)
                self._active.discard(rid)
                continue
            if self.error is not None:
                self._post([(rid, EngineFailure(f"the engine failed earlier: {self.error}", False))])
                continue
            try:
                add_to_engine(self.engine, rid, command[2], command[3])
            except UserError as exc:
                self._post([(rid, EngineFailure(str(exc), True))])
                continue
            self._active.add(rid)

    def _fail_all(self, message: str) -> None:
        failed = list(self._active)
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is broken already; the requests still get their error
                log.exception("abort after a failed step")
        self._active.clear()
        self._post([(rid, EngineFailure(message, False)) for rid in failed])
