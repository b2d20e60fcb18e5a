"""bench/soak.py: its traffic is a function of the seed, its outcomes are classified as documented, and a
short soak against a live `quantkit serve` (its own: the soak kills its engine) sees every kind of request
answered as it should, the KV blocks back to 0, and a killed engine found, restarted and timed."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from quantkit_testing.serve_process import SERVED_NAME, ServerProcess, metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # bench/ lives at the repository root
from bench.lib.soak_client import Result  # noqa: E402
from bench.lib.soak_report import UNEXPECTED, classify  # noqa: E402
from bench.lib.soak_requests import BAD_BODIES, INVALID_FIELDS, MIX, Traffic  # noqa: E402
from bench.lib.soak_server import compute_apps_mib, engine_process, metric, parse_metrics  # noqa: E402
from bench.soak import SoakConfig, soak  # noqa: E402


def test_traffic_is_a_function_of_the_seed():
    a, b = Traffic("m", 256, 40, 16, seed=1), Traffic("m", 256, 40, 16, seed=2)
    specs = [a.spec(i) for i in range(200)]
    assert specs == [Traffic("m", 256, 40, 16, seed=1).spec(i) for i in reversed(range(200))][::-1]
    assert [s.body for s in specs] != [b.spec(i).body for i in range(200)]
    assert [s.kind[0] for s in specs[:len(MIX)]] == list(MIX)
    invalid = {a.spec(i).name for i in range(2000) if a.spec(i).kind == "invalid"}
    assert invalid == {*INVALID_FIELDS, *BAD_BODIES, "deep-json", "content-type", "too-long-prompt"}


def test_outcomes():
    restarting = [(10.0, 20.0)]

    def outcome(kind: str, status=None, ended=5.0, **kw) -> str:
        return classify(Result(kind, "x", started=0.0, ended=ended, status=status, **kw), restarting)

    assert outcome("valid", 200, complete=True) == "ok"
    assert outcome("valid", 200) == "failed"                     # truncated
    assert outcome("valid", None) == "failed"                    # no answer
    assert outcome("leave", None, complete=True) == "ok-disconnected"
    assert outcome("valid", 429) == "unexpected-4xx"
    assert outcome("invalid", 415) == "expected-4xx"
    assert outcome("invalid", 200, complete=True) == "invalid-accepted"
    engine_down = dict(server_error=True, message="HTTP 500: the engine process exited (exit code -9)")
    assert outcome("valid", 500, ended=12.0, **engine_down) == "5xx-expected"
    assert outcome("valid", 500, ended=25.0, **engine_down) == "5xx-unexpected"        # no kill of ours then
    assert outcome("valid", 503, ended=12.0, server_error=True, retry_after=True) == "5xx-expected"
    assert outcome("valid", 500, ended=12.0, server_error=True, message="HTTP 500: KeyError") == "5xx-unexpected"
    assert outcome("invalid", 500, ended=12.0, server_error=True, message="RecursionError") == "5xx-unexpected"


def test_server_readings():
    assert compute_apps_mib("1234, 5120\n77, [N/A]\n1234, 100\n\n") == {1234: 5220.0}
    values = parse_metrics('# HELP x\nquantkit_kv_blocks_used 3\nreq{endpoint="chat"} 2\n'
                           'req{endpoint="completions"} 5\n')
    assert metric(values, "quantkit_kv_blocks_used") == 3 and metric(values, "req") == 7
    assert metric(values, "quantkit_engine_restarts_total") is None


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    proc = ServerProcess(str(chat_model_dir), "--served-model-name", SERVED_NAME, "--num-kv-tokens", "4096",
                         "--max-batch-size", "32", "--quiet", log=tmp_path_factory.mktemp("soak-bench") / "server.log")
    yield proc
    proc.stop()


def config(server, **kw) -> SoakConfig:
    return SoakConfig(url=server.url, minutes=0.1, concurrency=4, seed=0, server_pid=server.pid,
                      max_output_tokens=16, max_rss_drift=10.0, idle_wait_s=20.0, timeout=60.0, **kw)


def test_soak_sends_every_kind_and_each_is_answered_as_it_should(server):
    rep = soak(config(server))
    assert rep.outcomes.get("ok", 0) >= 5, rep.outcomes
    assert rep.outcomes.get("ok-disconnected", 0) >= 1, rep.outcomes
    assert rep.outcomes.get("expected-4xx", 0) >= 1, rep.outcomes
    for name, counts in rep.by_name.items():
        kind = name.split(":")[0]
        assert set(counts) == {"expected-4xx" if kind == "invalid" else "ok-disconnected" if kind == "leave"
                               else "ok"}, (name, counts, rep.examples)
    assert not any(rep.outcomes.get(o) for o in UNEXPECTED) and rep.failures == [], rep.failures
    assert rep.kv_blocks_used_end == 0 and rep.in_flight_end == 0
    assert rep.engine_restarts == 0 and rep.kills == []
    assert rep.rss_mib[0] > 100 and rep.rss_mib[1] > 100     # the server and its engine process, in MiB
    assert rep.latency_p50_s is not None and rep.latency_p50_s <= rep.latency_p99_s


def test_kill_finds_the_engine_and_times_its_restart(server):
    """Last in this file: it kills the server's engine (which the server restarts)."""
    engine = engine_process(server.pid)
    assert engine is not None and engine.ppid() == server.pid
    assert "spawn_main" in " ".join(engine.cmdline())
    for child in psutil.Process(server.pid).children():   # multiprocessing's resource tracker is left alone
        if "resource_tracker" in " ".join(child.cmdline()):
            assert child.pid != engine.pid
    rep = soak(config(server, kill_engine_at=(2.0,), max_recovery_s=60.0, recovery_wait_s=60.0))
    kill, = rep.kills
    assert kill.pid == engine.pid and kill.recovery_s is not None and kill.recovery_s <= 60.0, kill
    assert rep.engine_restarts == 1
    assert engine_process(server.pid).pid != engine.pid
    assert not any(rep.outcomes.get(o) for o in UNEXPECTED) and rep.failures == [], (rep.failures, rep.examples)
    assert rep.kv_blocks_used_end == 0 and metrics(server.url)["quantkit_num_requests_in_flight"] == 0
