"""Bad input and faults: OpenAI's error body for malformed JSON, wrong types, unknown models, prompts over
the context; 401 with --api-key; 429 with Retry-After when the queue is full; a client that leaves
mid-stream aborts its request and frees its KV blocks; SIGTERM drains running requests and exits 0;
bad command lines are one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from quantkit_testing.serve_process import SERVED_NAME, ServerProcess, assert_error, metrics, wait_idle

KEY = "sekret-key"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "the model"}]


@pytest.mark.parametrize("body, status, param, code", [
    (b"{", 400, None, "invalid_json"),
    (b"", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"messages": "hi"}, 400, "messages", "invalid_type"),
    ({"messages": USER, "max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
    ({"messages": USER, "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"messages": USER, "stop": 5}, 400, "stop", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    ({"max_tokens": 3}, 400, "messages", "missing_required_parameter"),
    ({"messages": USER, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": "the model " * 200}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": USER, "logit_bias": {"5": 1}}, 400, "logit_bias", "unsupported_parameter"),
    ({"messages": USER, "tools": [{"type": "function"}]}, 400, "tools.0.function", "missing_required_parameter"),
    ({"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"messages": USER, "n": 1000}, 400, "n", "invalid_value"),
])
def test_chat_errors_have_openais_body(qk_server, body, status, param, code):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    assert_error(requests.post(qk_server.url + CHAT, timeout=30, **kwargs), status, param, code)


def test_completion_errors(qk_server):
    url = qk_server.url + "/v1/completions"
    assert_error(requests.post(url, json={"prompt": [1, 99999]}, timeout=30), 400, "prompt", "invalid_value")
    assert_error(requests.post(url, json={"prompt": "x", "echo": True}, timeout=30), 400, "echo",
                 "unsupported_parameter")
    assert_error(requests.post(url, json={"prompt": list(range(3, 300))}, timeout=30), 400, "prompt",
                 "context_length_exceeded")
    # GET with a JSON body is validated the same way.
    assert_error(requests.get(url, data=b"{nope", timeout=30), 400, None, "invalid_json")


def test_unknown_routes_and_methods(qk_server):
    assert_error(requests.get(qk_server.url + "/v2/nothing", timeout=30), 404)
    assert_error(requests.delete(qk_server.url + "/v1/models", timeout=30), 405)


def test_openai_client_sees_the_errors(qk_server):
    import openai

    client = openai.OpenAI(base_url=qk_server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x " * 400}])
    assert exc.value.code == "context_length_exceeded"


# --- a server with a key and a one-sequence batch plus a one-sequence queue -------------------------

@pytest.fixture(scope="module")
def keyed(chat_model_dir, tmp_path_factory):
    server = ServerProcess(str(chat_model_dir), "--served-model-name", SERVED_NAME, "--api-key", KEY,
                           "--max-batch-size", "1", "--max-queue", "1", "--num-kv-tokens", "1024", "--quiet",
                           log=tmp_path_factory.mktemp("keyed") / "server.log")
    yield server
    server.stop()


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key(keyed):
    body = {"messages": USER, "max_tokens": 2}
    err = assert_error(requests.post(keyed.url + CHAT, json=body, timeout=30), 401, None, "invalid_api_key")
    assert "Authorization" in err["message"]
    assert_error(requests.post(keyed.url + CHAT, json=body, headers=auth("wrong"), timeout=30), 401, None,
                 "invalid_api_key")
    assert_error(requests.get(keyed.url + "/v1/models", headers={"Authorization": KEY}, timeout=30), 401, None,
                 "invalid_api_key")
    assert requests.post(keyed.url + CHAT, json=body, headers=auth(), timeout=30).status_code == 200
    assert requests.get(keyed.url + "/v1/models", headers=auth(), timeout=30).status_code == 200
    assert requests.get(keyed.url + "/health", timeout=30).status_code == 200   # monitoring needs no key
    assert requests.get(keyed.url + "/metrics", timeout=30).status_code == 200


def _open_stream(url: str, max_tokens: int) -> requests.Response:
    r = requests.post(url + CHAT, headers=auth(), stream=True, timeout=30,
                      json={"messages": USER, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    assert r.status_code == 200
    return r


def test_queue_full_is_429_and_leaving_clients_free_their_blocks(keyed):
    import openai

    before = metrics(keyed.url)
    running = _open_stream(keyed.url, 230)
    lines = running.iter_lines()
    for _ in range(3):                                   # the role chunk and two tokens: it runs
        assert next(lines).startswith(b"data: ")
        next(lines)
    waiting = _open_stream(keyed.url, 230)               # accepted: it waits for the batch's only slot
    m = metrics(keyed.url)
    assert m["quantkit_num_requests_in_flight"] == 2 and m["quantkit_kv_blocks_used"] > 0
    r = requests.post(keyed.url + CHAT, headers=auth(), json={"messages": USER, "max_tokens": 2}, timeout=30)
    assert_error(r, 429, None, "rate_limit_exceeded")
    assert r.headers["Retry-After"] == "1"
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=SERVED_NAME, messages=USER, max_tokens=2)
    # Both clients leave mid-stream: their requests are aborted, every KV block comes back.
    running.close()
    waiting.close()
    after = wait_idle(keyed.url)
    assert after["quantkit_kv_blocks_used"] == 0 and after["quantkit_num_requests_in_flight"] == 0
    aborted = 'quantkit_requests_total{endpoint="chat",finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 2
    rejected = "quantkit_requests_rejected_queue_full_total"
    assert after[rejected] - before[rejected] == 2
    assert after["quantkit_generation_tokens_total"] < before["quantkit_generation_tokens_total"] + 2 * 230
    # The slot is free again.
    assert requests.post(keyed.url + CHAT, headers=auth(), json={"messages": USER, "max_tokens": 2},
                         timeout=30).status_code == 200


def test_sigterm_drains_the_running_request_and_exits_0(keyed):
    """Last in this module: it stops the keyed server."""
    n = 120
    r = _open_stream(keyed.url, n)
    got: list[bytes] = []
    first = threading.Event()

    def read() -> None:
        for line in r.iter_lines():
            if line:
                got.append(line)
                if b'"content":"' in line and b'"content":""' not in line:
                    first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(30)
    keyed.proc.send_signal(signal.SIGTERM)
    assert keyed.proc.wait(timeout=60) == 0
    reader.join(10)
    assert got[-1] == b"data: [DONE]"
    finish = json.loads(got[-2][len(b"data: "):])["choices"][0]
    assert finish["finish_reason"] == "length"          # ran to its end, not aborted
    assert "quantkit serve: stopped" in keyed.output()
    with pytest.raises(requests.ConnectionError):        # nothing listens any more
        requests.get(keyed.url + "/health", timeout=5)


# --- the command line --------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "quantkit.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_bad_command_lines_are_one_line_errors(chat_model_dir, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cases = [
            ((str(chat_model_dir), "--kv-bits", "5", "--port", "0"), "--kv-bits 5"),
            ((str(tmp_path / "missing"), "--port", "0"), "not found"),
            ((str(chat_model_dir), "--port", str(busy.getsockname()[1])), "cannot listen"),
            ((str(chat_model_dir), "--kv-scales", "bogus", "--port", "0"), "--kv-scales 'bogus'"),
        ]
        for args, words in cases:
            start = time.monotonic()
            proc = _cli(*args)
            assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (args, proc.stderr)
            assert "Traceback" not in proc.stderr + proc.stdout
            assert time.monotonic() - start < 60      # refused before any model is loaded
    finally:
        busy.close()


def test_static_kv_scales_without_statistics_is_one_line(chat_model_dir):
    proc = _cli(str(chat_model_dir), "--kv-bits", "8", "--kv-scales", "static", "--port", "0", "--device", "cpu")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "kv-calibrate" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_serve_config_and_model_argument_checks(tmp_path):
    from quantkit.config import UserError
    from quantkit.server.launch import ServeConfig, bind
    from quantkit.server.model_source import check_model_arg

    for kwargs, words in [(dict(port=70000), "--port 70000"), (dict(max_queue=-1), "--max-queue"),
                          (dict(api_key=" "), "--api-key"), (dict(shutdown_timeout=-2.0), "--shutdown-timeout")]:
        with pytest.raises(UserError, match=words):
            ServeConfig(model="m", **kwargs)
    assert ServeConfig(model="/models/tiny-chat/").model_name == "tiny-chat"
    assert ServeConfig(model="random:tiny:w4").model_name == "random:tiny:w4"
    assert ServeConfig(model="m", served_model_name="x").model_name == "x"
    for bad in ("random:llama9:w4", "random:tiny", "random:tiny:w3"):
        with pytest.raises(UserError, match="random:SHAPE:WEIGHTS"):
            check_model_arg(bad)
    assert check_model_arg("random:llama2-7b:w4") == ("llama2-7b", "w4")
    assert check_model_arg(str(tmp_path)) is None
    sock = bind("127.0.0.1", 0)
    sock.listen()
    try:
        with pytest.raises(UserError, match="cannot listen"):
            bind("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


# --- a random-weight model whose engine process dies --------------------------------------------------

@pytest.fixture(scope="module")
def random_server(tmp_path_factory):
    server = ServerProcess("random:tiny:fp16", "--num-kv-tokens", "1024", "--quiet",
                           log=tmp_path_factory.mktemp("random") / "server.log")
    yield server
    server.stop()


def test_random_model_and_its_byte_tokenizer(random_server):
    url = random_server.url
    assert requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "random:tiny:fp16"
    # The byte tokenizer: one prompt token per byte of the templated chat.
    body = {"model": "random:tiny:fp16", "messages": USER, "max_tokens": 4, "ignore_eos": True}
    out = requests.post(url + CHAT, json=body, timeout=60).json()
    templated = f"<|user|>\n{USER[0]['content']}\n<|assistant|>\n"
    assert out["usage"]["prompt_tokens"] == len(templated.encode()) and out["usage"]["completion_tokens"] == 4
    # (What happens when its engine process dies: tests/server/test_supervision.py.)
    assert random_server.stop() == 0
