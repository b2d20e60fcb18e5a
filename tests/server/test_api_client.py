"""`quantkit api-client`: streamed answers, the history sent with every turn, `clear` and `exit`, Ctrl-C (a
real SIGINT) stopping one answer and the server's request with it, one-line errors. Against the scripted
server of tests/support/quantkit_testing/fake_openai.py."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from quantkit_testing.fake_openai import FakeOpenAI
from quantkit_testing.serve_process import wait_for
from quantkit.server.api_client import (ApiChatSession, ChatOptions, OpenAIClient, ServerError, api_client,
                                        parse_server_url, run_api_client, sse_data)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", "api-client", *args]


# `quantkit api-client` as a terminal starts it: SIGINT raises KeyboardInterrupt, even when the tests run
# where SIGINT is ignored (a background job), a disposition the child would otherwise inherit.
AS_IN_A_TERMINAL = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                    "sys.argv[0] = 'quantkit'; from quantkit.cli import main; main()")


def cli_in_a_terminal(*args: str) -> list[str]:
    return [sys.executable, "-c", AS_IN_A_TERMINAL, "api-client", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_turns_stream_and_carry_the_history():
    with FakeOpenAI() as fake:
        options = ChatOptions(model="fake-model", system="be brief", temperature=0.5, max_tokens=7)
        session = ApiChatSession(OpenAIClient(fake.url), options)
        out, err = io.StringIO(), io.StringIO()
        run_api_client(session, io.StringIO("hello\n\nagain\nclear\nthird\nexit\nnever read\n"), out, err)
    answer = "".join(fake.words)
    system = {"role": "system", "content": "be brief"}
    sent = [r.body for r in fake.chats()]
    assert [b["messages"] for b in sent] == [
        [system, {"role": "user", "content": "hello"}],
        [system, {"role": "user", "content": "hello"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "again"}],
        [system, {"role": "user", "content": "third"}],  # after `clear`
    ]
    assert all(b["stream"] and b["model"] == "fake-model" and b["temperature"] == 0.5 and b["max_tokens"] == 7
               for b in sent)
    assert out.getvalue().count(answer) == 3 and "(new conversation)" in out.getvalue()
    assert out.getvalue().count(">>> ") == 6 and not err.getvalue()


def test_answer_is_written_piece_by_piece():
    with FakeOpenAI(delay=0.05) as fake:
        session = ApiChatSession(OpenAIClient(fake.url), ChatOptions())
        pieces: list[tuple[float, str]] = []
        text = session.answer("hi", lambda s: pieces.append((time.monotonic(), s)))
    assert text == "".join(fake.words) and [p for _, p in pieces] == fake.words
    assert pieces[-1][0] - pieces[0][0] > 0.25  # as they came, not all at the end
    assert "model" not in fake.chats()[0].body  # no --model and no default asked here: the server's choice


def test_server_errors_are_one_line_and_the_chat_goes_on():
    with FakeOpenAI(fail=(400, "the prompt is longer than the context (300 > 256 tokens)")) as fake:
        session = ApiChatSession(OpenAIClient(fake.url), ChatOptions(model="fake-model"))
        out, err = io.StringIO(), io.StringIO()
        run_api_client(session, io.StringIO("too long\nexit\n"), out, err)
        assert err.getvalue() == (f"error: {fake.url} answered: the prompt is longer than the context "
                                  "(300 > 256 tokens) (HTTP 400)\n")
        assert session.messages == []  # the failed turn is taken back
        fake.fail = None
        run_api_client(session, io.StringIO("short\n"), out, err)
    assert fake.chats()[-1].body["messages"] == [{"role": "user", "content": "short"}]


def test_api_key_and_model_from_the_server():
    with FakeOpenAI(api_key="sk-test", model="tiny-chat") as fake:
        with pytest.raises(ServerError, match=r"missing or wrong API key \(HTTP 401\)"):
            OpenAIClient(fake.url).models()
        client = OpenAIClient(fake.url + "/v1", api_key="sk-test")
        assert client.models() == ["tiny-chat"]
        assert ApiChatSession(client, ChatOptions()).answer("hi", lambda s: None) == "".join(fake.words)
    assert all(r.headers["Authorization"] == "Bearer sk-test" for r in fake.requests[1:])


def test_sse_parsing():
    stream = io.BytesIO(b": comment\r\ndata: {\"a\": 1}\r\n\r\ndata:two\ndata: lines\n\nevent: x\n\ndata: [DONE]\n\n")
    assert list(sse_data(stream)) == ['{"a": 1}', "two\nlines", "[DONE]"]
    assert parse_server_url("127.0.0.1:23333/v1/").origin == "http://127.0.0.1:23333"
    assert parse_server_url("https://h/api/v1").base_path == "/api"


def test_unreachable_server_is_one_line_and_exit_2():
    proc = subprocess.run(cli(f"http://127.0.0.1:{free_port()}"), input="", capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert "cannot reach" in proc.stderr and "connection refused" in proc.stderr


def _read_until(stream, marker: str, seen: list[str], timeout: float = 20.0) -> str:
    """Read the subprocess's output (one os.read at a time, none blocking past the deadline) until
    `marker` appears in it."""
    deadline = time.monotonic() + timeout
    while marker not in "".join(seen):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(left, 0))
        assert ready, f"no {marker!r} within {timeout} s in {''.join(seen)!r}"
        data = os.read(stream.fileno(), 4096).decode()
        assert data, f"the client exited before {marker!r}: {''.join(seen)!r}"
        seen.append(data)
    return "".join(seen)


def test_ctrl_c_stops_the_answer_not_the_client():
    with FakeOpenAI(words=[f"w{i} " for i in range(40)], delay=0.04) as fake:
        proc = subprocess.Popen(cli_in_a_terminal(fake.url, "--max-tokens", "100"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            seen: list[str] = []
            _read_until(proc.stdout, ">>> ", seen)
            proc.stdin.write("first\n")
            proc.stdin.flush()
            _read_until(proc.stdout, "w2 ", seen)
            proc.send_signal(signal.SIGINT)
            out = _read_until(proc.stdout, "[stopped]\n\n>>> ", seen)
            proc.stdin.write("second\nexit\n")
            proc.stdin.flush()
            rest, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        first = fake.requests.index(fake.chats()[0])
        assert wait_for(lambda: fake.aborted == [first], 10, "the abort")  # the server saw the first answer stopped
    assert proc.returncode == 0, err
    partial = out.split(">>> ")[1].split(" [stopped]")[0]
    assert partial.startswith("w0 w1 w2 ") and "w39" not in partial
    # The part printed is in the history of the next turn, which is answered in full.
    assert fake.chats()[1].body["messages"][1] == {"role": "assistant", "content": partial}
    assert "w39" in rest


def test_bad_flags_are_refused():
    proc = subprocess.run(cli("http://127.0.0.1:1", "--temperature", "-1"), capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --temperature must be ≥ 0, not -1.0"


def test_entry_point_picks_the_first_model(monkeypatch, capsys):
    with FakeOpenAI(model="tiny-chat") as fake:
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        api_client(fake.url, options=ChatOptions(system="s"))
    assert fake.chats()[0].body["model"] == "tiny-chat"
    assert f"{fake.url} · model tiny-chat" in capsys.readouterr().out


def test_against_quantkit_serve(qk_server):
    """`quantkit api-client` in a subprocess against `quantkit serve` (tiny random model, greedy): each
    answer printed is what the server gives for the whole conversation so far."""
    proc = subprocess.run(cli(qk_server.url, "--temperature", "0", "--max-tokens", "6", "--system", "be brief"),
                          input="the model quantizes weights\nand the cache keeps keys\nexit\n",
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    model = requests.get(qk_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert proc.stdout.startswith(f"{qk_server.url.rstrip('/')} · model {model}\n")

    def whole(messages: list[dict]) -> str:
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 6}
        return requests.post(qk_server.url + "/v1/chat/completions", json=body, timeout=60).json()[
            "choices"][0]["message"]["content"]

    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model quantizes weights"}]
    first = whole(history)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "and the cache keeps keys"}]
    second = whole(history)
    assert first and second
    assert f">>> {first}\n\n>>> {second}\n\n>>> " in proc.stdout


def test_json_schema_against_quantkit_serve(qk_server, tmp_path):
    """`--json-schema FILE`: every answer is JSON valid under the schema; a file that is no schema is one line."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
              "required": ["word"], "additionalProperties": False}
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(schema))
    proc = subprocess.run(cli(qk_server.url, "--max-tokens", "40", "--json-schema", str(path)),
                          input="the model quantizes weights\nexit\n", capture_output=True, text=True, timeout=60,
                          env=ENV)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    answer = proc.stdout.split(">>> ")[1].strip()
    assert set(json.loads(answer)) == {"word"} and json.loads(answer)["word"].isalpha()
    path.write_text("[1]")
    bad = subprocess.run(cli(qk_server.url, "--json-schema", str(path)), input="x\n", capture_output=True,
                         text=True, timeout=60, env=ENV)
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: {path} holds a JSON list, not a schema (an object)"
