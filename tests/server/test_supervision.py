"""Supervision of the engine by a real `quantkit serve` process: an engine process SIGKILLed under an open
stream ends that stream with an error event and [DONE] and is restarted (the server answers normal
requests again, /metrics counts the restart); a stalled step is found by the watchdog and restarted; a
spent restart budget, or a failed step with --engine-thread, exits the server non-zero.

Stalls and step failures are injected through the step loop's `before_step` hook, passed to the server by
quantkit_testing.serve_with_faults (a file `stall` or `crash` in the fault directory fires once, at the next
step)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import requests

from quantkit_testing.serve_process import ServerProcess, metrics, wait_for

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "the cache keeps keys"}], "max_tokens": 4, "ignore_eos": True}
RECOVERY_S = 60


def engine_process(server_pid: int) -> psutil.Process:
    """The engine: the child that multiprocessing spawned (not its resource tracker)."""
    children = [p for p in psutil.Process(server_pid).children()
                if "spawn_main" in " ".join(p.cmdline()) and p.is_running()]
    assert len(children) == 1, children
    return children[0]


def serves(url: str) -> bool:
    try:
        return requests.post(url + CHAT, json=BODY, timeout=30).status_code == 200
    except requests.RequestException:
        return False


def start(tmp_path: Path, *args: str) -> ServerProcess:
    faults = tmp_path / "faults"
    faults.mkdir(exist_ok=True)
    return ServerProcess("random:tiny:fp16", "--num-kv-tokens", "1024", *args, log=tmp_path / "server.log",
                         faults=faults)


def test_a_killed_engine_ends_the_open_stream_and_is_restarted(tmp_path):
    server = start(tmp_path)
    try:
        url = server.url
        first = engine_process(server.pid)
        stream = requests.post(url + CHAT, stream=True, timeout=60,
                               json={**BODY, "max_tokens": 900, "stream": True})
        lines = (line for line in stream.iter_lines() if line)
        next(lines), next(lines)                       # the role chunk and a token: the request is running
        (tmp_path / "faults" / "stall").touch()        # hold the engine mid-answer (no watchdog yet: 120 s)
        wait_for(lambda: not (tmp_path / "faults" / "stall").exists(), 30, "the stall to fire")
        first.kill()
        rest = list(lines)
        assert rest[-1] == b"data: [DONE]"
        error = json.loads(rest[-2][len(b"data: "):])["error"]
        assert error["type"] == "server_error" and "restarting" in error["message"]
        health = requests.get(url + "/health", timeout=10)
        if health.status_code == 503:                  # restarting: clients are told when to come back
            assert health.json()["status"] == "restarting" and int(health.headers["Retry-After"]) > 0
        wait_for(lambda: serves(url), RECOVERY_S, "the restarted engine to serve")
        m = metrics(url)
        assert m["quantkit_engine_restarts_total"] == 1 and m["quantkit_engine_up"] == 1
        assert engine_process(server.pid).pid != first.pid
        assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        assert server.stop() == 0


def test_the_watchdog_restarts_a_stalled_engine(tmp_path):
    server = start(tmp_path, "--engine-step-timeout", "2")
    try:
        url = server.url
        assert serves(url)
        (tmp_path / "faults" / "stall").touch()
        r = requests.post(url + CHAT, json={**BODY, "max_tokens": 50}, timeout=60)
        assert r.status_code == 503 and "no progress" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) > 0
        wait_for(lambda: serves(url), RECOVERY_S, "the restarted engine to serve")
        assert metrics(url)["quantkit_engine_restarts_total"] == 1
    finally:
        assert server.stop() == 0


def test_a_spent_restart_budget_exits_non_zero(tmp_path):
    server = start(tmp_path, "--engine-restarts", "0")
    assert serves(server.url)
    engine_process(server.pid).kill()
    code = wait_for(lambda: server.proc.poll(), 60, "the server to exit")
    assert code not in (0, None)
    assert "exits with an error so that its supervisor" in server.output()
    server.stop()


def test_a_failed_step_in_the_engine_thread_exits_non_zero(tmp_path):
    server = start(tmp_path, "--engine-thread")
    assert serves(server.url)
    (tmp_path / "faults" / "crash").touch()
    r = requests.post(server.url + CHAT, json=BODY, timeout=60)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    code = wait_for(lambda: server.proc.poll(), 60, "the server to exit")
    assert code not in (0, None)
    server.stop()
