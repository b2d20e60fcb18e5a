"""A small scripted OpenAI-compatible server for the client tests (the page, webui's proxy, api-client).

It records every request, streams its answer one word per chunk with a pause between chunks (so that a
test can tell streaming from an answer sent at once), and notes the streams its client cut off (at once,
also during a pause, as uvicorn does).
Loopback only, port chosen by the OS; a thread per connection.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict
    body: Optional[dict]


@dataclass
class FakeOpenAI:
    """`words`: the answer, one chunk each, `delay` seconds apart. `api_key`: required when set (401
    otherwise). `fail`: (status, message) answered to every chat request instead of a stream."""

    words: list[str] = field(default_factory=lambda: [f"w{i} " for i in range(8)])
    delay: float = 0.05
    model: str = "fake-model"
    api_key: Optional[str] = None
    fail: Optional[tuple[int, str]] = None
    requests: list[Recorded] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)  # indexes into `requests` of streams cut off
    finished: list[int] = field(default_factory=list)  # ... of streams sent to the end

    def __post_init__(self) -> None:
        # The script a test gives must be one the clients can meet: words to stream, an error status.
        assert self.words and self.delay >= 0, "FakeOpenAI needs words to stream and a delay ≥ 0"
        assert self.fail is None or 400 <= self.fail[0] < 600, f"fail needs an HTTP error status: {self.fail}"
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self._handle()

            def do_POST(self) -> None:  # noqa: N802
                self._handle()

            def _json(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                self._json(status, {"error": {"message": message, "type": "invalid_request_error",
                                              "param": None, "code": status}})

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                fake.requests.append(Recorded(self.command, self.path, dict(self.headers), body))
                index = len(fake.requests) - 1
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    return self._error(401, "missing or wrong API key")
                if self.path == "/v1/models":
                    return self._json(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                if self.path != "/v1/chat/completions":
                    return self._error(404, f"no route {self.path}")
                if fake.fail:
                    return self._error(*fake.fail)
                if not body.get("stream"):
                    text = "".join(fake.words)
                    return self._json(200, {"object": "chat.completion", "model": fake.model, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
                self._stream(index, body)

            def _stream(self, index: int, body: dict) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def event(obj) -> None:
                    data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                def chunk(delta: dict, finish=None) -> dict:
                    return {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "model": fake.model,
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

                def pause() -> None:
                    """Wait `delay` seconds, noticing at once a client that leaves (as uvicorn does)."""
                    readable, _, _ = select.select([self.connection], [], [], fake.delay)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        raise ConnectionResetError("the client left")

                try:
                    event(chunk({"role": "assistant", "content": ""}))
                    for word in fake.words:
                        pause()
                        event(chunk({"content": word}))
                    event(chunk({}, "stop"))
                    if (body.get("stream_options") or {}).get("include_usage"):
                        event({"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "choices": [],
                               "usage": {"prompt_tokens": 5, "completion_tokens": len(fake.words),
                                         "total_tokens": 5 + len(fake.words)}})
                    event("[DONE]")
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    fake.finished.append(index)
                except (BrokenPipeError, ConnectionResetError):
                    fake.aborted.append(index)
                    self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def chats(self) -> list[Recorded]:
        return [r for r in self.requests if r.path == "/v1/chat/completions"]

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
