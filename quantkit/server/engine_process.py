"""EngineProcess: the engine in a process of its own, fed through two pipes, restarted when it dies or hangs
(what `quantkit serve` runs).

Why not a thread: the step and the HTTP side are both Python, and in one process they take turns on
the GIL. Every torch call of the step releases the GIL and must win it back, so while the event loop
writes a step's worth of tokens to its sockets the next step waits, and the accelerator idles. In its
own process the engine steps back to back whatever the HTTP side does; the two exchange small pickled
messages: commands one way (add, abort, stop), the StepLoop's messages the other (step_loop.py).

Supervision: when the process exits (a failed step, a crash, an OOM kill) or the watchdog finds no step
for `step_timeout` seconds with requests pending (then it is killed), the requests in flight are failed
at once (503, retry), and a new process is started after a back-off (1 s, doubled for each restart
within `restart_window`). More than `max_restarts` restarts in the window, or a new process that cannot
load: the server gives up (`on_fatal`) and exits non-zero, for its own supervisor to restart.

The worker ignores SIGINT and SIGTERM (the server drains and then stops it) and exits when the server's
end of a pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any, Callable, Optional

from quantkit.config import UserError
from quantkit.server.engine_loop import RETRY_AFTER_S, EngineClient, Supervision
from quantkit.server.engine_requests import EngineInfo
from quantkit.server.step_loop import PipeInbox, StepLoop

log = logging.getLogger(__name__)


def engine_main(model: str, config: Any, tokenizer: Optional[str], commands, outputs, log_level: int,
                before_step: Optional[Callable[[], None]] = None) -> None:
    """The engine process: load, report ("ready", EngineInfo, stats) or ("error", message), then run the
    StepLoop (with `before_step`). A step that fails as a whole ends the process with exit code 1 after
    ("fatal", message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # other libraries: warnings, as the server
    logging.getLogger("quantkit").setLevel(log_level)                  # ours at the server's level (start-up phases)
    from quantkit.server.model_source import load_engine

    try:
        engine = load_engine(model, config, tokenizer)
    except UserError as exc:
        outputs.send(("error", str(exc)))
        return
    except Exception as exc:
        log.exception("loading %s failed", model)
        outputs.send(("error", f"loading {model} failed: {type(exc).__name__}: {exc}"))
        return
    outputs.send(("ready", EngineInfo.of(engine), engine.stats()))
    try:
        StepLoop(engine, PipeInbox(commands), outputs.send, before_step).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):   # the server is gone
        pass
    except BaseException as exc:
        log.exception("the engine step failed; the engine process exits")
        try:
            outputs.send(("fatal", f"the engine step failed: {type(exc).__name__}: {exc}"))
        finally:
            logging.shutdown()
            os._exit(1)   # no interpreter teardown: after a device fault it may hang


class _Incarnation:
    """One engine process and the two threads that talk to it: a sender (commands) and a receiver."""

    def __init__(self, model: str, config: Any, tokenizer: Optional[str], before_step: Optional[Callable]) -> None:
        ctx = multiprocessing.get_context("spawn")    # a fresh interpreter: no CUDA or threads inherited
        cmd_recv, self.cmd_send = ctx.Pipe(duplex=False)
        self.out_recv, out_send = ctx.Pipe(duplex=False)
        level = logging.getLogger("quantkit").getEffectiveLevel()
        self.proc = ctx.Process(target=engine_main, name="quantkit-engine",
                                args=(model, config, tokenizer, cmd_recv, out_send, level, before_step))
        self._child_ends = (cmd_recv, out_send)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.death: Optional[str] = None              # why it ended, when the server knows better than an exit code
        self.stopping = False

    def launch(self) -> tuple[EngineInfo, dict]:
        """Start the process and wait until the model is loaded; a UserError if it could not be."""
        self.proc.start()
        for end in self._child_ends:
            end.close()
        try:
            message = self.out_recv.recv()
        except (EOFError, OSError):
            self.proc.join(10)
            raise UserError(f"the engine process exited while loading (exit code {self.proc.exitcode}); "
                            "see the lines above") from None
        except BaseException:   # Ctrl-C while the model loads: the process ignores SIGINT, so end it here
            self.kill()
            raise
        if message[0] == "error":
            self.proc.join(30)
            raise UserError(message[1])
        return message[1], message[2]

    def start(self, on_message: Callable[[tuple], None], on_exit: Callable[[], None]) -> None:
        self.threads = [threading.Thread(target=self._send_commands, name="quantkit-engine-send", daemon=True),
                        threading.Thread(target=self._receive, args=(on_message, on_exit),
                                         name="quantkit-engine-receive", daemon=True)]
        for t in self.threads:
            t.start()

    def send(self, command: tuple) -> None:
        self.outbox.put(command)

    def kill(self) -> None:
        """End the process now (non-blocking but for a short join)."""
        self.stopping = True
        self.outbox.put(None)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def shutdown(self, timeout: float) -> None:
        """Blocking: tell the process to stop (the commands queued before still apply), close its command
        pipe (which ends it too), wait, kill it if it is still there."""
        self.stopping = True
        self.outbox.put(("stop",))
        self.outbox.put(None)
        if self.threads:
            self.threads[0].join(5)
        else:  # never started serving: no sender thread
            try:
                self.cmd_send.send(("stop",))
            except OSError:
                pass
        self.cmd_send.close()
        if self.proc.pid is None:
            return
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.join(10)

    def _send_commands(self) -> None:
        while True:
            command = self.outbox.get()
            if command is None:
                return
            try:
                self.cmd_send.send(command)
            except (BrokenPipeError, OSError):  # the process is gone; the receiver reports it
                return

    def _receive(self, on_message: Callable[[tuple], None], on_exit: Callable[[], None]) -> None:
        while True:
            try:
                message = self.out_recv.recv()
            except (EOFError, OSError):
                self.out_recv.close()
                if not self.stopping:
                    on_exit()
                return
            if message[0] == "fatal":
                self.death = message[1]
            else:
                on_message(message)


class EngineProcess(EngineClient):
    """The server's side of the engine process: `launch` (blocking, before serving), then `start` in the
    event loop. See the module docstring for the restarts; `before_step` (picklable) goes to every
    process's StepLoop."""

    def __init__(self, model: str, config: Any, tokenizer: Optional[str] = None,
                 supervision: Optional[Supervision] = None, before_step: Optional[Callable[[], None]] = None) -> None:
        super().__init__(supervision)
        self._args = (model, config, tokenizer, before_step)
        self._current: Optional[_Incarnation] = None   # the process serving now (None while restarting)
        self._starting: Optional[_Incarnation] = None  # a restart's process while it loads
        self._restart_times: list[float] = []
        self._restart_task: Optional[asyncio.Task] = None
        self._stopping = False

    @property
    def pid(self) -> Optional[int]:
        """The engine process's pid (None while it restarts)."""
        return None if self._current is None else self._current.proc.pid

    def launch(self) -> EngineInfo:
        """Start the first process and wait until the model is loaded; a UserError if it could not be."""
        self._current = _Incarnation(*self._args)
        self.info, self._stats = self._current.launch()
        return self.info

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.state = "running"
        self._attach(self._current)
        self._start_watchdog()

    def _attach(self, inc: _Incarnation) -> None:
        inc.start(lambda message: self._call(self._message_from, inc, message),
                  lambda: self._call(self._exited, inc))

    def _send(self, command: tuple) -> None:
        if self._current is not None:
            self._current.send(command)

    # --- supervision (event-loop thread) ------------------------------------------------------------------

    def _message_from(self, inc: _Incarnation, message: tuple) -> None:
        if inc is self._current:   # a dead process's last words are not news
            self._on_message(message)

    def _exited(self, inc: _Incarnation) -> None:
        if inc is not self._current or self._stopping:
            return
        inc.proc.join(1)
        self._died(inc.death or f"the engine process exited (exit code {inc.proc.exitcode})")

    def _hung(self, seconds: float) -> None:
        self._died(f"the engine made no progress for {seconds:.0f} s with requests pending "
                   "(--engine-step-timeout); it was killed")

    def _died(self, reason: str) -> None:
        dead, self._current = self._current, None
        if dead is not None:
            dead.kill()
        self.error = reason
        log.error("%s", reason)
        self._fail_in_flight(f"the engine stopped ({reason}); it is restarting: send the request again",
                             RETRY_AFTER_S)
        if self._stopping:
            return
        now = time.monotonic()
        window = self.supervision.restart_window
        self._restart_times = [t for t in self._restart_times if now - t < window]
        if len(self._restart_times) >= self.supervision.max_restarts:
            self._give_up(f"{reason}; {len(self._restart_times)} restart(s) in the last {window:.0f} s already, "
                          f"the most --engine-restarts allows")
            return
        self._restart_times.append(now)
        self.restarts += 1
        self.state = "restarting"
        delay = self.supervision.backoff * 2 ** (len(self._restart_times) - 1)
        log.warning("restarting the engine in %.0f s (restart %d)", delay, self.restarts)
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(delay))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        inc = self._starting = _Incarnation(*self._args)
        try:
            _, stats = await asyncio.get_running_loop().run_in_executor(None, inc.launch)
        except Exception as exc:
            self._starting = None
            if not self._stopping:
                self._current = inc
                self._died(f"the restarted engine could not start: {exc}")
            return
        self._starting = None
        if self._stopping:
            inc.kill()
            return
        self._current, self._stats = inc, stats
        self.state, self.error = "running", None
        self._last_heard = time.monotonic()
        self._attach(inc)
        log.warning("the engine is serving again (restart %d)", self.restarts)

    # --- stopping ------------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Abort what is left, stop the process (killed if it does not end within 30 s)."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stop_watchdog()
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Blocking and idempotent: stop the serving process (and one a restart is loading)."""
        if self._stopping:
            return
        self._stopping = True
        self.state = "stopped"
        if self._starting is not None:
            self._starting.kill()
        if self._current is not None:
            self._current.shutdown(timeout)
