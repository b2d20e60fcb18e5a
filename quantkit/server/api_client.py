"""`quantkit api-client URL`: a terminal chat against any OpenAI-compatible server.

The loop is `quantkit chat`'s (quantkit/engine/chat.py): streamed answers, the whole conversation sent
with every turn, `exit` and `clear`, Ctrl-C stopping the answer that streams (what was printed stays in
the history) while Ctrl-C at the prompt, or the end of input, leaves. Here an answer is read from
`POST /v1/chat/completions` with `stream: true`; Ctrl-C closes that connection, which is how an
OpenAI-compatible server learns to abort the request. Only the standard library is used (http.client),
so the client starts fast and needs nothing that a server-less install lacks.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, TextIO
from urllib.parse import urlsplit

from quantkit.config import UserError, read_json_schema
from quantkit.console import chat_loop
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # one silent gap this long (a long prompt on a slow server) ends the answer


class ServerError(UserError):
    """The server could not be reached, or answered with an error."""


@dataclass(frozen=True)
class Upstream:
    """Where an OpenAI-compatible server listens: `base_path` is what precedes `/v1/...` ('' mostly)."""

    scheme: str
    host: str
    port: int
    base_path: str

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def connection(self, timeout: float = CONNECT_TIMEOUT_S) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)


def parse_server_url(url: str) -> Upstream:
    """`http://host:port` (a trailing `/v1`, as OpenAI clients' base_url has it, is accepted and dropped)."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"not a server URL: {url!r} (expected http://HOST:PORT, e.g. http://127.0.0.1:23333)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UserError(f"not a server URL: {url!r} (the port must be a number from 1 to 65535)") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return Upstream(parts.scheme, parts.hostname, port, path)


def _message_of(parsed: object) -> str:
    """The message of an error body: OpenAI's `{"error": {"message"}}`, or FastAPI's `{"detail"}`."""
    if not isinstance(parsed, dict):
        return ""
    err = parsed.get("error") or parsed.get("detail")
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return str(err or "")


def error_message(status: int, body: bytes) -> str:
    """One line from an error response: the body's message (or its text) and the status."""
    try:
        message = _message_of(json.loads(body))
    except ValueError:
        message = body.decode("utf-8", "replace")
    message = " ".join(message.split())[:300]
    return f"{message} (HTTP {status})" if message else f"HTTP {status}"


def sse_data(response: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, one per event, as they arrive."""
    data: list[str] = []
    while True:
        raw = response.readline()
        if not raw:  # end of the stream
            break
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
    if data:
        yield "\n".join(data)


class OpenAIClient:
    """The few calls of the OpenAI API a chat needs, over plain HTTP(S)."""

    def __init__(self, url: str, api_key: Optional[str] = None) -> None:
        self.upstream = parse_server_url(url)
        self.api_key = api_key

    def _open(self, method: str, path: str, body: Optional[dict] = None,
              read_timeout: float = READ_TIMEOUT_S) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; returns the connection and its response of status 200 (close both when done),
        raises ServerError for anything else."""
        conn = self.upstream.connection()
        headers = {"Accept": "application/json, text/event-stream"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.connect()
            conn.sock.settimeout(read_timeout)
            conn.request(method, self.upstream.base_path + path, body=payload, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                text = response.read()
                conn.close()
                raise ServerError(f"{self.upstream.origin} answered: {error_message(response.status, text)}")
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ServerError(f"cannot reach {self.upstream.origin}: {_reason(exc)}") from None
        except BaseException:  # the error answer above, or Ctrl-C while waiting: no socket left open
            conn.close()
            raise
        return conn, response

    def models(self) -> list[str]:
        """The ids that `GET /v1/models` lists."""
        conn, response = self._open("GET", "/v1/models", read_timeout=CONNECT_TIMEOUT_S)
        try:
            return [m["id"] for m in json.loads(response.read())["data"]]
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"{self.upstream.origin}/v1/models did not answer an OpenAI model list") from None
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"the connection to {self.upstream.origin} broke: {_reason(exc)}") from None
        finally:
            conn.close()

    def stream_chat(self, body: dict) -> Iterator[dict]:
        """The chunks of `POST /v1/chat/completions` with `stream: true`; closing the iterator (or an
        exception inside it, Ctrl-C's included) closes the connection, so the server aborts the request."""
        conn, response = self._open("POST", "/v1/chat/completions", {**body, "stream": True})
        try:
            if "text/event-stream" not in (response.getheader("Content-Type") or ""):
                yield json.loads(response.read())  # a server that ignores `stream`: one whole answer
                return
            for data in sse_data(response):
                if data.strip() == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error"):
                    message = " ".join(_message_of(chunk).split())[:300] or "an error chunk"
                    raise ServerError(f"{self.upstream.origin} stopped the answer: {message}")
                yield chunk
        except ServerError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"the connection to {self.upstream.origin} broke: {_reason(exc)}") from None
        except ValueError:
            raise ServerError(f"{self.upstream.origin} sent a chunk that is not JSON") from None
        finally:
            # Both: the response holds the socket's file, the connection the socket itself (keep-alive).
            response.close()
            conn.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the server running on that port?)"
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return "unknown host name"
    return str(exc) or type(exc).__name__


def chunk_text(chunk: dict) -> str:
    """The text a chat chunk adds (`delta.content`), or a whole answer's (`message.content`)."""
    parts = []
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or choice.get("message") or {}).get("content")
        if piece:
            parts.append(piece)
    return "".join(parts)


@dataclass
class ChatOptions:
    """What every request of the conversation carries besides the messages (None: the server's default)."""

    model: Optional[str] = None
    system: Optional[str] = None
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    json_schema: Optional[str] = None   # a file holding a JSON schema: answers come as JSON valid under it

    def response_format(self) -> Optional[dict]:
        """OpenAI's response_format for `json_schema` (read now: a bad file is a UserError before any turn)."""
        if self.json_schema is None:
            return None
        from pathlib import Path

        path = Path(self.json_schema)
        schema = read_json_schema(path)  # config's reader: this client needs no torch
        return {"type": "json_schema", "json_schema": {"name": path.stem or "answer", "schema": schema}}


class ApiChatSession:
    """A conversation with a server: the messages so far and one streamed answer at a time."""

    def __init__(self, client: OpenAIClient, options: ChatOptions) -> None:
        self.client, self.options = client, options
        self.response_format = options.response_format()
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.options.system}] if self.options.system else []

    def request_body(self) -> dict:
        body: dict = {"messages": self.messages}
        for key in ("model", "temperature", "max_tokens"):
            value = getattr(self.options, key)
            if value is not None:
                body[key] = value
        if self.response_format is not None:
            body["response_format"] = self.response_format
        return body

    def answer(self, user_text: str, write) -> str:
        """Stream the answer to `user_text` through `write`; returns it (the part written when Ctrl-C
        stopped it) and keeps both turns in the history. A server error that came before any text takes
        the turn back and raises ServerError; one in the middle keeps the part written, then raises."""
        self.messages.append({"role": "user", "content": user_text})
        parts: list[str] = []
        stream = self.client.stream_chat(self.request_body())
        try:
            for chunk in stream:
                piece = chunk_text(chunk)
                if piece:
                    parts.append(piece)
                    write(piece)
        except KeyboardInterrupt:
            stream.close()  # closes the connection: the server aborts the request
            write(" [stopped]")
        except ServerError:
            if not parts:
                self.messages.pop()
                raise
            self.messages.append({"role": "assistant", "content": "".join(parts)})
            raise
        text = "".join(parts)
        self.messages.append({"role": "assistant", "content": text})
        return text


def run_api_client(session: ApiChatSession, stdin: Optional[TextIO] = None, stdout: Optional[TextIO] = None,
                   stderr: Optional[TextIO] = None) -> None:
    """Read messages from `stdin` until `exit` (or end of input, or Ctrl-C at the prompt), answering each
    on `stdout`; a failed turn prints one `error:` line on `stderr` and the conversation goes on.
    (Defaults: the sys streams of the moment of the call.)"""
    chat_loop(session, stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr,
              turn_errors=(ServerError,), interrupt_stops_answer=True)


def api_client(url: str, api_key: Optional[str] = None, options: Optional[ChatOptions] = None) -> None:
    """`quantkit api-client`: check the server (and pick its first model when none is named), then chat."""
    options = options or ChatOptions()
    client = OpenAIClient(url, api_key)
    models = client.models()
    if options.model is None:
        if not models:
            raise ServerError(f"{client.upstream.origin}/v1/models lists no model: name one with --model")
        options.model = models[0]
    print(f"{client.upstream.origin} · model {options.model}", flush=True)
    run_api_client(ApiChatSession(client, options))
