"""One request's fault is that request's alone, as a client sees it: over an engine whose sampler fails
for one request's settings, that request is answered 500 (whole) or with an error event and [DONE]
(streamed), while requests running beside it get their full answers and the server stays healthy."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from quantkit_testing.serve_process import wait_for
from quantkit_testing.tiny import poison_sampler

from quantkit.engine import Engine, EngineConfig

CHAT = "/v1/chat/completions"
POISON_SEED = 666


@pytest.fixture(scope="module")
def poisoned_url(chat_model_dir):
    """An in-process server (the engine in a thread) whose sampler raises for requests with POISON_SEED."""
    import uvicorn

    from quantkit.server.app import AppSettings, create_app

    engine = Engine(chat_model_dir, EngineConfig(device="cpu", num_kv_tokens=2048))
    poison_sampler(engine, POISON_SEED, OverflowError("Python int too large to convert to C long"))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, AppSettings(served_model_name="m")),
                                           log_level="warning", lifespan="on"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 60, "the server to start")
    assert server.started, "the server thread ended before it started"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    server.should_exit = True
    thread.join(30)
    sock.close()


def body(seed: int, **more) -> dict:
    return {"messages": [{"role": "user", "content": f"request {seed}"}], "max_tokens": 24, "temperature": 0.9,
            "seed": seed, "ignore_eos": True, **more}


def test_the_failing_request_fails_alone(poisoned_url):
    url, engine = poisoned_url
    with ThreadPoolExecutor(6) as pool:
        good = [pool.submit(requests.post, url + CHAT, json=body(i), timeout=120) for i in range(4)]
        bad = pool.submit(requests.post, url + CHAT, json=body(POISON_SEED), timeout=120)
        bad_stream = pool.submit(requests.post, url + CHAT, json=body(POISON_SEED, stream=True), timeout=120)
        good, bad, bad_stream = [f.result() for f in good], bad.result(), bad_stream.result()
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24 for r in good)
    assert bad.status_code == 500 and "OverflowError" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "server_error"
    events = [e[len("data: "):] for e in bad_stream.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "OverflowError" in json.loads(events[-2])["error"]["message"]
    # The engine went on: healthy, nothing held, and the next request is answered.
    assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert requests.post(url + CHAT, json=body(7), timeout=120).status_code == 200
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
