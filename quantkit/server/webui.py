"""`quantkit webui URL`: the chat page of `quantkit serve`, served against any OpenAI-compatible server.

The page asks for relative URLs (`v1/models`, `v1/chat/completions`), so this server sends the page at
`/` and forwards every `/v1/...` request to URL, streaming the answer through as it arrives. A proxy,
rather than a page that calls URL itself, because then the browser talks to one origin: no CORS, which
most servers (lmdeploy, vLLM without flags, `quantkit serve`) do not allow by default; the API key can
stay on this side (`--api-key`, never sent to the browser); and the upstream may listen on a loopback
address the browser cannot reach. When the browser stops an answer it closes its connection; a
watcher sees that at once and closes the upstream connection, which is how an OpenAI-compatible
server learns to abort the request.

Standard library only (http.server, http.client), one thread per connection: a chat page has a few
clients, and webui then runs wherever quantkit is installed, beside any server.
"""

from __future__ import annotations

import errno
import http.client
import json
import select
import socket
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

from quantkit.config import UserError
from quantkit.server.api_client import (CONNECT_TIMEOUT_S, READ_TIMEOUT_S, OpenAIClient, ServerError, Upstream,
                                        parse_server_url)

PAGE = Path(__file__).parent / "static" / "chat.html"
# Request headers passed upstream; the rest (Host, Connection, Accept-Encoding, ...) are this hop's own.
FORWARDED = ("Content-Type", "Accept", "Authorization", "User-Agent", "OpenAI-Organization", "OpenAI-Project")
# Response headers passed back (length and transfer encoding are set by this server).
RETURNED = ("Content-Type", "Cache-Control", "Retry-After", "X-Request-Id")


def page_bytes() -> bytes:
    """The chat page (quantkit/server/static/chat.html), as served at `/`."""
    return PAGE.read_bytes()


@dataclass(frozen=True)
class WebUIConfig:
    """`quantkit webui`'s flags: the upstream server, where the page listens, the upstream's API key."""

    url: str
    host: str = "127.0.0.1"
    port: int = 6006
    api_key: Optional[str] = None


def openai_error(message: str, status: int, kind: str = "proxy_error") -> bytes:
    """OpenAI's error body, as the page and the clients read it."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked streaming
    server: "WebUIServer"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(200, page_bytes(), "text/html; charset=utf-8", {"Cache-Control": "no-cache"})
        elif path == "/health":
            self._send(200, b'{"status": "ok"}', "application/json")
        elif path.startswith("/v1/"):
            self._proxy()
        else:
            self._send_error(404, f"no such page: {path} (the chat is at /, the API under /v1/)", "not_found")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.startswith("/v1/"):
            self._proxy()
        else:
            self._send_error(404, f"no such route: POST {self.path}", "not_found")

    def _send(self, status: int, body: bytes, content_type: str, headers: Optional[dict] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, status: int, message: str, kind: str = "proxy_error") -> None:
        self._send(status, openai_error(message, status, kind), "application/json")

    def _proxy(self) -> None:
        """Forward this request to the upstream server and its response back, streamed."""
        upstream: Upstream = self.server.upstream
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: self.headers[k] for k in FORWARDED if self.headers.get(k)}
        if self.server.api_key:
            headers["Authorization"] = f"Bearer {self.server.api_key}"
        conn = upstream.connection(CONNECT_TIMEOUT_S)
        try:
            conn.connect()
            conn.sock.settimeout(READ_TIMEOUT_S)
            conn.request(self.command, upstream.base_path + self.path, body=body, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            self._send_error(502, f"cannot reach the server at {upstream.origin}: {exc or type(exc).__name__}")
            return
        try:
            self._relay(conn, response)
        finally:
            response.close()
            conn.close()

    def _relay(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self.send_response(response.status)
        for key in RETURNED:
            if response.getheader(key):
                self.send_header(key, response.getheader(key))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        done = threading.Event()
        watcher = threading.Thread(target=_close_upstream_when_client_leaves,
                                   args=(self.connection, conn, done), daemon=True)
        watcher.start()
        try:
            while True:
                try:
                    data = response.read1(65536)
                except (OSError, http.client.HTTPException):
                    # The upstream broke off (or the watcher closed it): no end-of-body marker, so the
                    # browser sees a cut stream, not a finished answer.
                    self.close_connection = True
                    return
                if not data:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True  # the browser left; the caller closes the upstream connection
        finally:
            done.set()


def _close_upstream_when_client_leaves(client: socket.socket, upstream: http.client.HTTPConnection,
                                       done: threading.Event) -> None:
    """While a response streams, watch the browser's socket: when it closes, shut the upstream socket so
    the relay stops at once and the upstream server sees its client leave (and aborts the request)."""
    while not done.is_set():
        readable, _, _ = select.select([client], [], [], 0.1)
        if not readable or done.is_set():
            continue
        try:
            still_open = bool(client.recv(1, socket.MSG_PEEK))
        except OSError:
            still_open = False
        if still_open:  # the browser sent its next request early: it is still there, stop watching
            return
        sock = upstream.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return


class WebUIServer(ThreadingHTTPServer):
    """The page and the /v1 proxy on `host:port`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, config: WebUIConfig, verbose: bool = False) -> None:
        self.upstream = parse_server_url(config.url)
        self.api_key = config.api_key
        self.verbose = verbose
        try:
            super().__init__((config.host, config.port), _Handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {config.port} is in use on {config.host}: pick another with --port") from None
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


def webui(config: WebUIConfig) -> None:
    """`quantkit webui`: serve the chat page against `config.url` until Ctrl-C."""
    server = WebUIServer(config)
    try:
        models = OpenAIClient(config.url, config.api_key).models()
        upstream_note = f"model {', '.join(models) or '(none listed)'}"
    except ServerError as exc:  # the page shows it too; the upstream may come up later
        upstream_note = f"not answering yet: {exc}"
    print(f"chat page on {server.url} for {server.upstream.origin} ({upstream_note}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
