"""Validation at the edge: every value that reaches the engine is one it can hold (token ids in the
vocabulary, a 64-bit seed, finite floats, min_tokens within max_tokens), the caps of RequestLimits and
their flags (prompts, messages, stop strings, JSON depth, body bytes: 413), a JSON Content-Type (415);
each answered with OpenAI's error body naming the field, and the server serving normally afterwards."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
import requests

from quantkit_testing.serve_process import SERVED_NAME, ServerProcess, assert_error, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "the model"}]
VOCAB = 320   # tests/support/quantkit_testing/tiny.py's TINY vocab_size: the model's, which the tokenizer's 300 ids fit in


def post_raw(url: str, body: bytes, content_type: str | None = "application/json") -> requests.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return requests.post(url, data=body, headers=headers, timeout=60)


def assert_serving(url: str) -> None:
    """A normal request of each endpoint succeeds, and nothing is left running."""
    r = requests.post(url + CHAT, json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    r = requests.post(url + COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    m = wait_idle(url)
    assert m["quantkit_num_requests_in_flight"] == 0 and m["quantkit_kv_blocks_used"] == 0


# Each: a field with a value the engine cannot hold (the crashes among them), the param named.
BOUNDS = [
    ({"top_k": 2**70}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"stop_token_ids": [-1], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"max_tokens": 2**31 + 1}, "max_tokens"),
    ({"min_tokens": 2**40}, "min_tokens"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty"),
    ({"repetition_penalty": 1e30}, "repetition_penalty"),
    ({"stop": ["x"] * 17}, "stop"),              # the default --max-stop 16
    ({"stop": "x" * 513}, "stop"),               # the default --max-stop-chars 512
]


@pytest.mark.parametrize("fields, param", BOUNDS)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_values_the_engine_cannot_hold_are_400_naming_the_field(qk_server, path, fields, param):
    body = {"messages": USER} if path == CHAT else {"prompt": "the model"}
    err = assert_error(requests.post(qk_server.url + path, json={**body, **fields}, timeout=60), 400, param,
                       "invalid_value")
    assert param in err["message"], err


@pytest.mark.parametrize("field, raw", [("temperature", "NaN"), ("top_p", "Infinity"), ("min_p", "-Infinity"),
                                        ("presence_penalty", "NaN"), ("repetition_penalty", "1e999")])
def test_non_finite_floats_are_400(qk_server, field, raw):
    body = b'{"prompt": "the model", "max_tokens": 2, "%s": %s}' % (field.encode(), raw.encode())
    err = assert_error(post_raw(qk_server.url + COMPLETIONS, body), 400, field, "invalid_value")
    assert "finite" in err["message"]


def test_edges_that_are_valid(qk_server):
    """The bounds' own ends are accepted: 64-bit seeds at both ends (seed + choice wraps), top_k of the whole
    vocabulary and its 'off' values, the last token id, min_tokens equal to max_tokens."""
    url = qk_server.url + COMPLETIONS
    for fields in ({"seed": 2**64 - 1, "n": 2, "temperature": 1}, {"seed": -2**63, "temperature": 1},
                   {"top_k": VOCAB, "temperature": 1}, {"top_k": -1}, {"top_k": 0},
                   {"stop_token_ids": [VOCAB - 1], "min_tokens": 2}, {"stop": ["x"] * 16}):
        r = requests.post(url, json={"prompt": [3, VOCAB - 1], "max_tokens": 2, **fields}, timeout=60)
        assert r.status_code == 200, (fields, r.text)
    r = requests.post(url, json={"prompt": "the", "max_tokens": 3, "min_tokens": 3, "stop_token_ids": [2]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_token_id_prompts_outside_the_vocabulary(qk_server):
    url = qk_server.url + COMPLETIONS
    for prompt in ([1, VOCAB], [-1, 5], [[5, 6], [7, 2**64]], [2**70]):
        err = assert_error(requests.post(url, json={"prompt": prompt, "max_tokens": 2}, timeout=60), 400, "prompt",
                           "invalid_value")
        assert f"[0, {VOCAB})" in err["message"], err


def test_lone_surrogates_are_400(qk_server):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    assert_error(post_raw(qk_server.url + CHAT, body), 400, "messages.0.content", "invalid_value")
    body = b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'
    assert_error(post_raw(qk_server.url + COMPLETIONS, body), 400, "prompt.1", "invalid_value")
    body = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'   # a pair: one character, fine
    assert post_raw(qk_server.url + COMPLETIONS, body).status_code == 200


def test_deep_nesting_and_huge_numbers_are_400(qk_server):
    url = qk_server.url + CHAT
    for body in (b"[" * 100_000, b'{"messages": ' + b"[" * 100_000, b'{"metadata": ' + b"[" * 70 + b"]" * 70 + b"}",
                 b'{"max_tokens": ' + b"9" * 5000 + b"}"):
        assert_error(post_raw(url, body), 400, None, "invalid_json")
    ok = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": %s}' % (b"[" * 60 + b"]" * 60)
    assert post_raw(url, ok).status_code == 200


def test_depth_counts_the_brackets_outside_strings():
    """In-process: the depth cap is on nesting, whatever the mix of arrays and objects, and brackets inside
    strings (escaped quotes included) are text."""
    from quantkit.server.protocol import APIError, CompletionRequest
    from quantkit.server.request_body import parse_request

    def body(levels: int, text: bytes = b"x") -> bytes:   # the top object plus levels - 1 nested
        inner = b'{"k": [' * ((levels - 1) // 2) + (b"[" if levels % 2 == 0 else b"") + b"1"
        inner += (b"]" if levels % 2 == 0 else b"") + b"]}" * ((levels - 1) // 2)
        return b'{"prompt": "%s", "metadata": %s}' % (text, inner)

    assert parse_request(body(64), CompletionRequest).prompt == "x"
    with pytest.raises(APIError, match="more than 64 deep"):
        parse_request(body(65), CompletionRequest)
    assert parse_request(body(64, b'[[[{\\"' * 50), CompletionRequest).prompt == '[[[{"' * 50


def test_content_type_must_be_json(qk_server):
    url = qk_server.url + CHAT
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "text/plain; charset=utf-8"):
        err = assert_error(post_raw(url, body, content_type), 415, None, "unsupported_media_type")
        assert "-H 'Content-Type: application/json'" in err["message"]
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.api+json", None):
        assert post_raw(url, body, content_type).status_code == 200, content_type


def test_default_body_cap_is_413_before_the_body_is_read(qk_server):
    """Content-Length over 16 MiB: answered at once, with only the headers sent."""
    status, payload = raw_exchange(qk_server.url, COMPLETIONS, {"Content-Length": str(16 * 2**20 + 1)}, b"{")
    assert status == 413
    assert payload["error"]["code"] == "request_too_large" and "--max-request-bytes" in payload["error"]["message"]


def raw_exchange(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
    """Send a request over a plain socket (headers as given, the body possibly short of its Content-Length)
    and read the answer until the server closes: (status, JSON body)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": parts.netloc, "Content-Type": "application/json",
                                                   **headers}.items())
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


# --- a server with small caps: the flags reach the checks ---------------------------------------------

@pytest.fixture(scope="module")
def capped(chat_model_dir, tmp_path_factory):
    server = ServerProcess(str(chat_model_dir), "--served-model-name", SERVED_NAME, "--num-kv-tokens", "1024",
                           "--max-request-bytes", "4096", "--max-prompts-per-request", "3", "--max-messages", "4",
                           "--max-stop", "2", "--max-stop-chars", "5", "--max-json-depth", "8", "--quiet",
                           log=tmp_path_factory.mktemp("capped") / "server.log")
    yield server
    server.stop()


def test_caps_follow_their_flags(capped):
    url = capped.url
    cases = [
        (COMPLETIONS, {"prompt": ["a", "b", "c", "d"]}, "prompt", "--max-prompts-per-request"),
        (COMPLETIONS, {"prompt": [[5], [6], [7], [8]]}, "prompt", "--max-prompts-per-request"),
        (CHAT, {"messages": USER * 5}, "messages", "--max-messages"),
        (CHAT, {"messages": USER, "stop": ["a", "b", "c"]}, "stop", "--max-stop"),
        (COMPLETIONS, {"prompt": "a", "stop": "sixsix"}, "stop", "--max-stop-chars"),
    ]
    for path, body, param, flag in cases:
        err = assert_error(requests.post(url + path, json={**body, "max_tokens": 2}, timeout=60), 400, param,
                           "invalid_value")
        assert flag in err["message"], err
    err = assert_error(post_raw(url + CHAT, b'{"messages": [[[[[[[[[1]]]]]]]]]}'), 400, None, "invalid_json")
    assert "--max-json-depth" in err["message"]
    # At the caps: served.
    for path, body in [(COMPLETIONS, {"prompt": ["a", "b", "c"], "stop": ["a", "fivec"]}),
                       (CHAT, {"messages": USER * 4})]:
        assert requests.post(url + path, json={**body, "max_tokens": 2}, timeout=60).status_code == 200


def test_body_cap_follows_its_flag(capped):
    url = capped.url + COMPLETIONS
    def body(size: int) -> bytes:
        empty = b'{"prompt": "a", "max_tokens": 1, "user": ""}'
        return empty[:-2] + b"x" * (size - len(empty)) + b'"}'

    assert len(body(4096)) == 4096 and post_raw(url, body(4096)).status_code == 200
    err = assert_error(post_raw(url, body(4097)), 413, None, "request_too_large")
    assert "4096" in err["message"]
    # No Content-Length (a chunked body): counted while read, refused once past the cap.
    status, payload = raw_exchange(capped.url, COMPLETIONS, {"Transfer-Encoding": "chunked"},
                                   b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(8)))
    assert status == 413 and payload["error"]["code"] == "request_too_large"
    pieces = (b'{"prompt": "a", ', b'"max_tokens": 1, ', b'"user": "%s"}' % (b"x" * 3000))
    r = requests.post(url, data=iter(pieces), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text   # chunked and under the cap: read whole
    assert_serving(capped.url)


def test_bad_values_in_serve_flags_are_one_line_errors():
    from quantkit.config import UserError
    from quantkit.server.limits import RequestLimits

    for kwargs, words in [(dict(max_request_bytes=0), "--max-request-bytes 0"), (dict(max_stop=-1), "--max-stop -1"),
                          (dict(max_json_depth=2.5), "--max-json-depth 2.5")]:
        with pytest.raises(UserError, match=words):
            RequestLimits(**kwargs)


def test_still_serving_after_the_bad_requests(qk_server):
    """Last in this module: every refusal above left the shared server as it was."""
    assert requests.get(qk_server.url + "/health", timeout=10).status_code == 200
    assert_serving(qk_server.url)
