"""`quantkit webui`: the page at /, /v1/* forwarded to an OpenAI-compatible server and streamed back as it
arrives, the API key added on this side, a browser that leaves aborting the upstream request, one-line
errors. Against the scripted server of tests/support/quantkit_testing/fake_openai.py."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from quantkit_testing.fake_openai import FakeOpenAI
from quantkit.config import UserError
from quantkit.server.webui import PAGE, WebUIConfig, WebUIServer


@contextmanager
def running_webui(url: str, api_key: str | None = None):
    server = WebUIServer(WebUIConfig(url=url, port=0, api_key=api_key))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def request(server: WebUIServer, method: str, path: str, body: dict | None = None,
            headers: dict | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}}


def test_page_at_root_is_self_contained():
    with FakeOpenAI() as fake, running_webui(fake.url) as server:
        response = request(server, "GET", "/")
        html = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/html")
    assert html == PAGE.read_text()
    # Offline: no script, style or font from anywhere else; the API is asked by relative URL.
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    assert 'fetch("v1/chat/completions"' in html and 'fetch("v1/models"' in html


def test_streams_through_as_it_arrives():
    with FakeOpenAI(delay=0.06) as fake, running_webui(fake.url + "/v1/") as server:
        models = json.loads(request(server, "GET", "/v1/models").read())
        assert [m["id"] for m in models["data"]] == ["fake-model"]
        response = request(server, "POST", "/v1/chat/completions", CHAT)
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        arrivals: list[tuple[float, bytes]] = []
        while data := response.read1(65536):
            arrivals.append((time.monotonic(), data))
    text = b"".join(d for _, d in arrivals).decode()
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    words = "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                    for e in events[:-1] if json.loads(e)["choices"])
    assert words == "".join(fake.words)
    assert json.loads(events[-2])["usage"]["completion_tokens"] == len(fake.words)
    # Forwarded as it came: the 8 words, 60 ms apart, arrive in several pieces spread over time.
    assert len(arrivals) >= 5
    assert arrivals[-1][0] - arrivals[0][0] > 0.25
    assert fake.chats()[0].body == CHAT


def test_api_key_added_and_upstream_errors_passed_back():
    with FakeOpenAI(api_key="sk-test") as fake:
        with running_webui(fake.url) as server:
            response = request(server, "POST", "/v1/chat/completions", CHAT)
            assert response.status == 401
            assert json.loads(response.read())["error"]["message"] == "missing or wrong API key"
        with running_webui(fake.url, api_key="sk-test") as server:
            # The flag's key replaces whatever the browser sends.
            response = request(server, "POST", "/v1/chat/completions", CHAT, {"Authorization": "Bearer wrong"})
            assert response.status == 200 and b"[DONE]" in response.read()
    assert fake.chats()[-1].headers["Authorization"] == "Bearer sk-test"


def test_unreachable_upstream_is_a_502_with_an_openai_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running_webui(f"http://127.0.0.1:{port}") as server:
        response = request(server, "POST", "/v1/chat/completions", CHAT)
        error = json.loads(response.read())["error"]
        missing = request(server, "GET", "/nothing")
    assert response.status == 502 and "cannot reach the server" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert missing.status == 404 and "error" in json.loads(missing.read())


def test_browser_leaving_aborts_the_upstream_request():
    with FakeOpenAI(words=[f"w{i} " for i in range(60)], delay=0.05) as fake, running_webui(fake.url) as server:
        response = request(server, "POST", "/v1/chat/completions", CHAT)
        assert b"data:" in response.read1(65536)
        left = time.monotonic()
        response.close()  # the socket closes: what a browser does on AbortController.abort()
        while not fake.aborted and time.monotonic() - left < 2.5:
            time.sleep(0.02)
        gone = time.monotonic() - left
        assert fake.aborted == [0] and not fake.finished
    # The whole answer takes 3 s; the upstream saw its client leave long before that.
    assert gone < 1.0


def test_browser_leaving_a_silent_upstream_aborts_it_at_once():
    """The upstream says nothing for 3 s (a long prompt): the browser's leaving is seen anyway, by the
    watcher of its socket, not at the next chunk."""
    with FakeOpenAI(words=["late"], delay=3.0) as fake, running_webui(fake.url) as server:
        response = request(server, "POST", "/v1/chat/completions", CHAT)
        assert b"data:" in response.read1(65536)  # the first (role) chunk
        left = time.monotonic()
        response.close()
        while not fake.aborted and time.monotonic() - left < 4.0:
            time.sleep(0.02)
        gone = time.monotonic() - left
        assert fake.aborted == [0] and not fake.finished
    assert gone < 1.0


def test_port_in_use_is_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} is in use"):
            WebUIServer(WebUIConfig(url="http://127.0.0.1:1", port=port))
    with pytest.raises(UserError, match="not a server URL"):
        WebUIServer(WebUIConfig(url="ftp://host/x", port=0))


def test_cli_serves_the_page():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FakeOpenAI() as fake:
        proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "webui", fake.url, "--port", str(port)],
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            banner = proc.stderr.readline()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/")
            assert b"quantkit chat" in conn.getresponse().read()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    assert f"http://127.0.0.1:{port}/" in banner and "fake-model" in banner
