"""EngineLoop: the one thread that steps the engine for every HTTP request.

The engine is not thread-safe, so only this thread touches it. The event loop hands it commands (add a
request, abort one) through a deque and wakes it; the thread applies them between steps, steps
back-to-back while any request is unfinished (no sleep between steps when work is queued), and hands
each step's outputs to the event loop in one `call_soon_threadsafe` call, where each request's sink
(its asyncio queue) receives its own. With nothing to do the thread sleeps on an Event.

The step runs outside the event loop, so HTTP keeps being served while the accelerator works; the GIL
is shared, so what each side does in Python per token is what it costs the other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, Callable, Optional, Union

from quantkit.config import UserError

log = logging.getLogger(__name__)


class EngineFailure:
    """What a request's sink receives instead of outputs when the engine could not take or finish it."""

    def __init__(self, message: str, user_error: bool) -> None:
        self.message, self.user_error = message, user_error
        self.finished = True


Sink = Callable[[Any], None]   # receives RequestOutputs, then maybe an EngineFailure; event-loop thread


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}            # event-loop thread only
        self._active: set[str] = set()               # engine thread only: requests added, not finished
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[str] = None             # set once a step failed: the server reports unhealthy
        self.steps = 0

    # --- the event loop's side ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; call from the event loop that will receive the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (as the event loop has seen them)."""
        return len(self._sinks)

    def add(self, request_id: str, token_ids: list[int], params: Any, sink: Sink) -> None:
        """Queue a request (prompt already tokenized, params resolved); its outputs go to `sink`."""
        self._sinks[request_id] = sink
        self._commands.append(("add", request_id, token_ids, params))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (a client left); its KV blocks are freed before the next step."""
        if self._sinks.pop(request_id, None) is not None:
            self._commands.append(("abort", request_id))
            self._wake.set()

    async def stop(self) -> None:
        """Abort whatever is left and end the thread."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    def _deliver(self, outputs: list) -> None:
        for rid, out in outputs:
            sink = self._sinks.get(rid)
            if sink is None:
                continue                               # aborted meanwhile
            if out.finished:
                del self._sinks[rid]
            sink(out)

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
                self._post([(out.request_id, out) for out in outputs])

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
                self.engine.add_request(command[2], command[3], rid)
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

    def _post(self, items: list[tuple[str, Union[Any, EngineFailure]]]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop closed between the check and the call (shutdown)
                pass
