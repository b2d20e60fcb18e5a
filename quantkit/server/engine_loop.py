"""The app's side of the engine: `EngineClient` (requests in flight, their outputs, the engine's health and
its watchdog) and `EngineLoop`, the engine stepped by a thread of this process.

The app talks to a backend through `EngineClient`: `add` a request (prompt tokenized, params resolved)
with a sink for its outputs, `abort` one, read `stats()`, `state`. Outputs reach the sinks on the event
loop's thread. Two backends run the same StepLoop (step_loop.py):

- `EngineProcess` (engine_process.py): the engine in a process of its own, what `quantkit serve` runs;
  a process that dies or hangs is restarted (bounded, with back-off).
- `EngineLoop` (here, `--engine-thread`): the engine in a thread of this process. A thread cannot be
  isolated: when its loop dies or hangs, the server gives up (`on_fatal`) and exits non-zero, so that
  a supervisor restarts it.

The watchdog: while requests are pending, the time since the step loop's last message (one per step)
may not pass `Supervision.step_timeout`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from quantkit.config import UserError
from quantkit.server.engine_requests import ChatWithImages, EngineFailure, EngineInfo, Sink, StepOutput
from quantkit.server.step_loop import StepLoop, ThreadInbox

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5   # what /health and refused requests tell clients while the engine restarts


@dataclass(frozen=True)
class Supervision:
    """How the server watches its engine (`quantkit serve --engine-step-timeout/--engine-restarts`)."""

    step_timeout: float = 120.0     # seconds without a finished step, requests pending: the engine hangs
    max_restarts: int = 3           # restarts within `restart_window`; one more failure and the server exits
    restart_window: float = 600.0   # seconds
    backoff: float = 1.0            # seconds before the first restart in the window, doubled for each next

    def __post_init__(self) -> None:
        if not self.step_timeout > 0:
            raise UserError(f"--engine-step-timeout {self.step_timeout} must be > 0 seconds")
        if self.max_restarts < 0:
            raise UserError(f"--engine-restarts {self.max_restarts} must be ≥ 0 (0: exit at the first failure)")


class EngineClient(abc.ABC):
    """The event loop's side of a backend (see the module docstring)."""

    info: EngineInfo

    def __init__(self, supervision: Optional[Supervision] = None) -> None:
        self.supervision = supervision or Supervision()
        self._sinks: dict[str, Sink] = {}            # event-loop thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stats: dict = {}
        self.state = "starting"                      # running, restarting, failed (or stopped)
        self.error: Optional[str] = None             # why the engine is not running
        self.restarts = 0                            # engine restarts since the server started
        self.on_fatal: Optional[Callable[[str], None]] = None   # the server exits non-zero (launch.py)
        self._last_heard = self._busy_since = time.monotonic()
        self._watchdog: Optional[asyncio.Task] = None

    @abc.abstractmethod
    def _send(self, command: tuple) -> None:
        """Deliver one command (add, abort, stop) to the engine's side."""

    @abc.abstractmethod
    def _hung(self, seconds: float) -> None:
        """The watchdog found no step for `seconds` with requests pending."""

    @property
    def alive(self) -> bool:
        """Whether the engine runs and takes requests."""
        return self.state == "running"

    @property
    def retry_after(self) -> Optional[int]:
        """Seconds a client should wait before trying again: while the engine restarts, else None."""
        return RETRY_AFTER_S if self.state in ("starting", "restarting") else None

    def stats(self) -> dict:
        """The engine's counters (Engine.stats) as last reported."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (as the event loop has seen them)."""
        return len(self._sinks)

    def add(self, request_id: str, prompt: Union[list[int], ChatWithImages], params: Any, sink: Sink) -> None:
        """Queue a request (token ids, or a chat with images; params resolved); its outputs go to `sink`."""
        if not self.alive:
            sink(EngineFailure(f"the engine is not running ({self.error or self.state})", False, self.retry_after))
            return
        if not self._sinks:
            self._busy_since = time.monotonic()
        self._sinks[request_id] = sink
        self._send(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        """Stop a request (a client left); its KV blocks are freed before the next step."""
        if self._sinks.pop(request_id, None) is not None and self.alive:
            self._send(("abort", request_id))

    # --- what the step loop reports (event-loop thread) ----------------------------------------------

    def _on_message(self, message: tuple) -> None:
        self._last_heard = time.monotonic()
        kind = message[0]
        if kind == "outputs":
            _, rows, failures, self._stats = message
            self._deliver([(row[0], StepOutput(*row[1:])) for row in rows])
            self._deliver([(rid, EngineFailure(f"the request failed in the engine: {error}", False))
                           for rid, error in failures])
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "rejected":
            _, rid, text, user_error = message
            self._deliver([(rid, EngineFailure(text, user_error))])

    def _deliver(self, outputs: list) -> None:
        for rid, out in outputs:
            sink = self._sinks.get(rid)
            if sink is None:
                continue                               # aborted meanwhile
            if out.finished:
                del self._sinks[rid]
            sink(out)

    def _fail_in_flight(self, message: str, retry_after: Optional[int] = None) -> None:
        self._deliver([(rid, EngineFailure(message, False, retry_after)) for rid in list(self._sinks)])

    def _call(self, fn: Callable, *args: Any) -> None:
        """Run fn on the event loop's thread (from any thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed between the check and the call (shutdown)
                pass

    # --- health ----------------------------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        timeout = self.supervision.step_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self.state == "running" and self._sinks:
                silent = time.monotonic() - max(self._last_heard, self._busy_since)
                if silent > timeout:
                    self._hung(silent)

    def _give_up(self, reason: str) -> None:
        """The engine cannot be brought back: fail what is in flight, report unhealthy, let the server exit."""
        self.state, self.error = "failed", reason
        log.error("the engine failed and is not restarted: %s", reason)
        self._fail_in_flight(f"the engine failed: {reason}")
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


class EngineLoop(EngineClient):
    """The engine stepped by a thread of this process (see the module docstring); `before_step` goes to
    its StepLoop."""

    def __init__(self, engine: Any, supervision: Optional[Supervision] = None,
                 before_step: Optional[Callable[[], None]] = None) -> None:
        super().__init__(supervision)
        self.engine, self.before_step = engine, before_step
        self.info = EngineInfo.of(engine)
        self._stats = engine.stats()
        self._inbox = ThreadInbox()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the thread; call from the event loop that will receive the outputs."""
        self._loop = asyncio.get_running_loop()
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()
        self._start_watchdog()

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)

    def _run(self) -> None:
        try:
            StepLoop(self.engine, self._inbox, lambda message: self._call(self._on_message, message),
                     self.before_step).run()
        except BaseException as exc:  # the engine's state is not trusted after a failed step
            log.exception("the engine step failed")
            self._call(self._give_up, f"the engine step failed: {type(exc).__name__}: {exc}")

    def _hung(self, seconds: float) -> None:
        self._give_up(f"the engine made no progress for {seconds:.0f} s with requests pending "
                      "(--engine-step-timeout)")

    async def stop(self) -> None:
        """Abort whatever is left and end the thread (not waited for when it failed: it may hang)."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stop_watchdog()
        failed = self.state == "failed"
        self.state = "stopped"
        self._inbox.put(("stop",))
        if self._thread is not None and not failed:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
