"""`serve(ServeConfig)`: bind the address, load the model, run the app under uvicorn until a signal.

The socket is bound before the model loads, so a busy port is reported at once, not after minutes of
loading. The engine runs in a process of its own (engine_process.py; restarted when it dies or hangs,
at most `engine_restarts` times in 10 minutes), or with `engine_thread` in a thread of this one
(engine_loop.py). When the engine cannot be brought back, the server stops and `serve` raises a
UserError: the command exits non-zero, for a supervisor to restart it. SIGTERM or Ctrl-C stops accepting connections, lets the running
requests finish (at most `shutdown_timeout` seconds, then they are aborted), stops the engine, and
returns: exit code 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from quantkit.config import UserError
from quantkit.engine.config import EngineConfig
from quantkit.engine.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImagePolicy
from quantkit.server.limits import RequestLimits

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """Everything `quantkit serve` takes: the model, the address, the HTTP limits and the engine's config."""

    model: str
    host: str = "127.0.0.1"
    port: int = 23333
    served_model_name: Optional[str] = None     # default: the model directory's name, or the random spec
    api_key: Optional[str] = None
    max_queue: int = 512
    tokenizer: Optional[str] = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    allow_origins: Sequence[str] = ()
    shutdown_timeout: Optional[float] = None    # seconds the running requests get after SIGTERM (None: all)
    access_log: bool = False
    log_level: str = "info"
    engine_thread: bool = False                 # step the engine in a thread of this process (for comparison)
    engine_step_timeout: float = 120.0          # seconds without a step, requests pending, before a restart
    engine_restarts: int = 3                    # restarts within 10 minutes before the server exits non-zero
    allowed_local_media_path: Optional[str] = None  # image parts may name files under it (None: data: URLs only)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    limits: RequestLimits = field(default_factory=RequestLimits)   # caps on one request's body (limits.py)
    tool_call_parser: Optional[str] = None      # tool_choice auto's format (None: from the chat template)

    def __post_init__(self) -> None:
        from quantkit.server.tool_calls import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise UserError(f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(PARSERS)}")
        root = self.allowed_local_media_path
        if root is not None and not os.path.isdir(root):
            raise UserError(f"--allowed-local-media-path {root} is not a directory: give the directory whose "
                            "images clients may name")
        if self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise UserError(f"--max-image-bytes {self.max_image_bytes} and --max-image-pixels "
                            f"{self.max_image_pixels} must be ≥ 1")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a port: use 1-65535 (0 picks a free one)")
        if self.max_queue < 0:
            raise UserError(f"--max-queue {self.max_queue} must be ≥ 0")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key is empty: give a key, or leave the flag out for no authentication")
        if self.shutdown_timeout is not None and self.shutdown_timeout < 0:
            raise UserError(f"--shutdown-timeout {self.shutdown_timeout} must be ≥ 0 seconds")

    def image_policy(self) -> ImagePolicy:
        root = self.allowed_local_media_path
        return ImagePolicy.served(None if root is None else os.path.realpath(root), self.max_image_bytes,
                                  self.max_image_pixels)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("random:"):
            return self.model
        from pathlib import Path

        return Path(self.model.rstrip("/")).name or self.model


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening); a one-line UserError when that fails."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} is not an address of this machine ({exc.strerror}): "
                        "use 127.0.0.1, 0.0.0.0 or a local interface's address") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port "
                        "(or stop the program using it)") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: ServeConfig, before_step: Optional[Callable[[], None]] = None) -> None:
    """Run the server until SIGTERM / Ctrl-C (see the module docstring). `before_step` runs in the engine's
    step loop before every step (tests inject faults through it; picklable for the engine process)."""
    try:
        import uvicorn

        from quantkit.server.app import AppSettings, create_app
    except ImportError as exc:
        raise UserError(f"quantkit serve needs the serve extra ({exc.name} is missing): "
                        "pip install 'quantkit[serve]'") from None
    from quantkit.server.engine_loop import EngineLoop, Supervision
    from quantkit.server.engine_process import EngineProcess
    from quantkit.server.model_source import check_model_arg, load_engine

    check_model_arg(config.model)
    sock = bind(config.host, config.port)
    url = url_of(sock)
    print(f"quantkit serve: loading {config.model}; will answer at {url}", flush=True)
    try:
        supervision = Supervision(step_timeout=config.engine_step_timeout, max_restarts=config.engine_restarts)
        if config.engine_thread:
            backend = EngineLoop(load_engine(config.model, config.engine, config.tokenizer), supervision, before_step)
            info = backend.info
        else:
            backend = EngineProcess(config.model, config.engine, config.tokenizer, supervision, before_step)
            info = backend.launch()
    except BaseException:
        sock.close()
        raise
    settings = AppSettings(
        served_model_name=config.model_name, model_aliases=(config.model,), api_key=config.api_key,
        max_queue=config.max_queue, allow_origins=tuple(config.allow_origins), images=config.image_policy(),
        limits=config.limits, tool_call_parser=config.tool_call_parser)
    ready = (f"quantkit serve: ready at {url} (model {config.model_name!r}, {info.num_blocks} KV blocks of "
             f"{info.block_size} tokens, context {info.max_model_len} tokens)")

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:   # listening now
                print(ready, flush=True)

    app = create_app(backend, settings)
    server = Server(uvicorn.Config(
        app, log_level=config.log_level, access_log=config.access_log, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout, timeout_keep_alive=30))
    fatal: list[str] = []

    def give_up(reason: str) -> None:   # the engine cannot be brought back: stop serving, exit non-zero
        fatal.append(reason)
        server.should_exit = True

    backend.on_fatal = give_up
    # uvicorn drains, then re-raises the signal it caught so that the default action (death by signal)
    # follows; a no-op handler in place makes that a plain return, and the exit code 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if isinstance(backend, EngineProcess):
            backend.shutdown()   # stopped with the app already; killed if it is still there
    if fatal:
        raise UserError(f"the engine failed and was not restarted ({fatal[0]}); the server exits with an error "
                        "so that its supervisor (systemd, Kubernetes) can restart it")
    if not server.started:
        raise UserError(f"the server did not start at {url} (see the lines above)")
    print("quantkit serve: stopped", file=sys.stderr, flush=True)
