"""EngineProcess: the engine in a process of its own, fed through two pipes (what `quantkit serve` runs).

Why not a thread: the step and the HTTP side are both Python, and in one process they take turns on
the GIL. Every torch call of the step releases the GIL and must win it back, so while the event loop
writes a step's worth of tokens to its sockets the next step waits, and the accelerator idles. In its
own process the engine steps back to back whatever the HTTP side does; the two exchange small pickled
messages: commands one way (add, abort, stop), each step's outputs and the engine's stats the other.

The worker applies the commands that have arrived before every step and blocks on the pipe only when
it has nothing to run. It ignores SIGINT and SIGTERM (the server drains and then stops it) and exits
when the server's end of a pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import threading
from typing import Any, Optional

from quantkit.config import UserError
from quantkit.server.engine_loop import EngineClient, EngineFailure, EngineInfo, add_to_engine, lean

log = logging.getLogger(__name__)


def engine_main(model: str, config: Any, tokenizer: Optional[str], commands, outputs, log_level: int) -> None:
    """The engine process: load, report ("ready", EngineInfo) or ("error", message), then serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(message)s")
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
        _Worker(engine, commands, outputs).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):   # the server is gone
        pass


class _Worker:
    def __init__(self, engine: Any, commands, outputs) -> None:
        self.engine, self.commands, self.outputs = engine, commands, outputs
        self.active: set[str] = set()
        self.error: Optional[str] = None

    def run(self) -> None:
        engine = self.engine
        while True:
            if self.error is not None or not engine.has_unfinished_requests():
                if not self.apply(self.commands.recv()):       # nothing to run: wait for a command
                    return
            while self.commands.poll():
                if not self.apply(self.commands.recv()):
                    return
            if self.error is not None or not engine.has_unfinished_requests():
                self.outputs.send(("stats", engine.stats()))     # aborts freed blocks without a step
                continue
            try:
                outs = engine.step()
            except Exception as exc:  # a bug or a device fault: fail every request, keep answering errors
                log.exception("engine step failed")
                self.error = f"{type(exc).__name__}: {exc}"
                failed = list(self.active)
                self.active.clear()
                for rid in failed:
                    try:
                        engine.abort(rid)
                    except Exception:
                        pass
                self.outputs.send(("failed", self.error, failed))
                continue
            for out in outs:
                if out.finished:
                    self.active.discard(out.request_id)
            self.outputs.send(("outputs", lean(outs), engine.stats()))

    def apply(self, command: tuple) -> bool:
        """Apply one command; False for stop."""
        kind = command[0]
        if kind == "stop":
            return False
        rid = command[1]
        if kind == "abort":
            self.engine.abort(rid)
            self.active.discard(rid)
        elif self.error is not None:
            self.outputs.send(("rejected", rid, f"the engine failed earlier: {self.error}", False))
        else:
            try:
                add_to_engine(self.engine, rid, command[2], command[3])
                self.active.add(rid)
            except UserError as exc:
                self.outputs.send(("rejected", rid, str(exc), True))
        return True


class EngineProcess(EngineClient):
    """The server's side of the engine process: `launch` (blocking, before serving), then `start` in
    the event loop; a thread sends the commands, another receives the outputs."""

    def __init__(self, model: str, config: Any, tokenizer: Optional[str] = None) -> None:
        super().__init__()
        ctx = multiprocessing.get_context("spawn")    # a fresh interpreter: no CUDA or threads inherited
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel()
        self.proc = ctx.Process(target=engine_main, name="quantkit-engine",
                                args=(model, config, tokenizer, cmd_recv, out_send, level))
        self._child_ends = (cmd_recv, out_send)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: dict = {}
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def launch(self) -> EngineInfo:
        """Start the process and wait until the model is loaded; a UserError if it could not be."""
        self.proc.start()
        for end in self._child_ends:
            end.close()
        try:
            message = self._out_recv.recv()
        except (EOFError, OSError):
            self.proc.join(10)
            raise UserError(f"the engine process exited while loading (exit code {self.proc.exitcode}); "
                            "see the lines above") from None
        except BaseException:   # Ctrl-C while the model loads: the process ignores SIGINT, so end it here
            self.proc.kill()
            self.proc.join(10)
            raise
        if message[0] == "error":
            self.proc.join(30)
            raise UserError(message[1])
        _, self.info, self._stats = message
        return self.info

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=self._send_commands, name="quantkit-engine-send", daemon=True),
                         threading.Thread(target=self._receive, name="quantkit-engine-receive", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def alive(self) -> bool:
        return self.proc.is_alive() and self.error is None

    def stats(self) -> dict:
        return self._stats

    def _send(self, command: tuple) -> None:
        self._outbox.put(command)

    async def stop(self) -> None:
        """Abort what is left, stop the process (killed if it does not end within 30 s)."""
        for rid in list(self._sinks):
            self.abort(rid)
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Blocking and idempotent: tell the process to stop (the commands queued before still apply), close
        its command pipe (which ends it too), wait, kill it if it is still there."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        if self._threads:
            self._threads[0].join(5)
        else:  # never started serving: no sender thread
            try:
                self._cmd_send.send(("stop",))
            except OSError:
                pass
        self._cmd_send.close()
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine process did not stop in %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.join(10)

    # --- threads ------------------------------------------------------------------------------------------

    def _send_commands(self) -> None:
        while True:
            command = self._outbox.get()
            if command is None:
                return
            try:
                self._cmd_send.send(command)
            except (BrokenPipeError, OSError):  # the process is gone; the receiver reports it
                return

    def _receive(self) -> None:
        while True:
            try:
                message = self._out_recv.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._call(self._process_died)
                return
            self._call(self._on_message, message)

    # --- the event loop's side ----------------------------------------------------------------------------

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self._stats = message[2]
            self._deliver_lean(message[1])
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "rejected":
            _, rid, text, user_error = message
            self._deliver([(rid, EngineFailure(text, user_error))])
        elif kind == "failed":
            self.error = message[1]
            self._fail_in_flight(f"the engine failed: {self.error}")

    def _process_died(self) -> None:
        self.proc.join(1)
        self.error = f"the engine process exited (exit code {self.proc.exitcode})"
        log.error("%s", self.error)
        self._fail_in_flight(self.error)
