"""`quantkit bench serve` against a fake OpenAI-compatible server of known timing.

The fake streams `max_tokens` tokens: a role-only chunk at once, the first token after TTFT seconds,
each next one ITL seconds later (no waits for the probes' max_tokens 2), then a usage chunk and [DONE]; it counts the prompt's words plus
FIXED as prompt tokens and records how many requests it had in flight at most. Its model name picks
a behaviour (failures, refused fields, no usage, two tokens a chunk).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import pytest

from aiohttp import web

from quantkit.cli import main
from quantkit.config import UserError
from quantkit.server.bench_dataset import load_jsonl
from quantkit.server.bench_report import markdown_table, write_report
from quantkit.server.bench_serve import BenchServeConfig, bench_serve

TTFT, ITL, FIXED = 0.10, 0.08, 5


class FakeServer:
    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = self.count = 0
        self.bodies: list[dict] = []
        self.stamps: list[tuple[float, float, float]] = []  # per answer: arrival, first token, last token
        self.ttft, self.itl = TTFT, ITL
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    def reset(self) -> None:
        self.in_flight = self.max_in_flight = self.count = 0
        self.bodies, self.stamps = [], []
        self.ttft, self.itl = TTFT, ITL

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-7b", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.json()
        model, n = body["model"], body["max_tokens"]
        self.bodies.append(body)
        self.count += 1
        chat = request.path.endswith("chat/completions")
        if model == "strict" and ("ignore_eos" in body or "min_tokens" in body):
            return _error(422, "Unexpected fields in the request: {'ignore_eos', 'min_tokens'}")
        if model == "fail-long" and n > 2:
            return _error(500, "boom")
        if model == "fail-odd" and n > 2 and self.count % 2:
            return _error(503, "queue full")
        if model == "slow" and n > 2:
            await asyncio.sleep(5)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(text.split()) + FIXED
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if chat:
                await _event(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            per_chunk = 2 if model == "double" else 1
            probe = n <= 2  # bench serve's probes (max_tokens 2) are answered at once
            await asyncio.sleep(0 if probe else self.ttft)
            first = time.perf_counter()
            for i in range(0, n, per_chunk):
                if i and not probe:
                    await asyncio.sleep(self.itl)
                last = time.perf_counter()
                words = " ".join("tok" for _ in range(min(per_chunk, n - i))) + " "
                choice = {"index": 0, "delta": {"content": words}} if chat else {"index": 0, "text": words}
                await _event(resp, {"choices": [choice]})
            if model != "no-usage":
                await _event(resp, {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                             "total_tokens": prompt_tokens + n}})
            await resp.write(b"data: [DONE]\n\n")
            if not probe:
                self.stamps.append((arrival, first, last))
            return resp
        finally:
            self.in_flight -= 1


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "x", "param": None, "code": status}},
                             status=status)


async def _event(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def server(fake):
    fake.reset()
    return fake


def run(server, **kw) -> dict:
    cfg = BenchServeConfig(url=server.url, **{"input_len": 64, "output_len": 3, **kw})
    return bench_serve(cfg, progress=False)


def test_timing_and_throughput_match_the_fake(server):
    result = run(server, model="fake-7b", concurrency=(4,), num_prompts=8)
    row = result.rows[0]
    assert (row["requests"], row["completed"], row["failed"]) == (8, 8, 0)
    # The fake's own clock (the same perf_counter, in this process) says when each answer arrived and
    # when its first and last tokens went out: on a busy machine its sleeps overrun, so the client's
    # figures are checked against these, allowing for delivery delays.
    stamps = server.stamps
    assert len(stamps) == 8
    ttft = sum(f - a for a, f, _ in stamps) / 8 * 1e3
    tpot = sum((last - f) / 2 for _, f, last in stamps) / 8 * 1e3
    latency = sum(last - a for a, _, last in stamps) / 8
    span = max(last for *_, last in stamps) - min(a for a, *_ in stamps)
    assert ttft >= TTFT * 1e3 and tpot >= ITL * 1e3
    # TTFT is the first token, not the role-only chunk sent at once.
    assert ttft <= row["mean_ttft_ms"] < ttft + 50
    # TPOT over output_len − 1 gaps (divided by output_len it would be a third less).
    assert 0.85 * tpot - 3 < row["mean_tpot_ms"] < 1.15 * tpot + 10
    assert latency <= row["latency_s"] < latency + 0.05
    # Two rounds of four clients: the level lasts from the first request sent to the last answer.
    assert span <= row["duration_s"] < span + 0.1
    assert row["output_throughput"] == pytest.approx(8 * 3 / row["duration_s"], rel=1e-3)
    assert row["request_throughput"] == pytest.approx(8 / row["duration_s"], rel=1e-3)
    # The random prompts are fitted to the server's count: 64 prompt tokens, template included.
    assert row["mean_input_tokens"] == 64
    assert row["input_throughput"] == pytest.approx(8 * 64 / row["duration_s"], rel=1e-3)
    assert (row["output_tokens_from"], row["input_tokens_from"]) == ("usage", "usage")
    assert server.max_in_flight == 4
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["min_tokens"]) == (3, True, 3)
    # Different prompts (no prefix-cache shortcut).
    prompts = [b["messages"][0]["content"] for b in server.bodies[-8:]]
    assert len(set(prompts)) == 8


def test_concurrency_puts_that_many_requests_in_flight(server):
    server.ttft = 1.0  # long enough for every client to have sent its request
    result = run(server, model="fake-7b", concurrency=(120,), num_prompts=120)
    assert result.rows[0]["completed"] == 120
    assert server.max_in_flight == 120  # above aiohttp's default limit of 100 connections


def test_failures_are_counted_with_their_message(server):
    result = run(server, model="fail-odd", concurrency=(2,), num_prompts=10)
    row = result.rows[0]
    assert row["failed"] + row["completed"] == 10 and 4 <= row["failed"] <= 6
    assert row["errors"] == {"HTTP 503: queue full": row["failed"]}


def test_a_level_where_all_fail_still_has_a_row(server, tmp_path):
    result = run(server, model="fail-long", concurrency=(1, 4), num_prompts=4)
    assert [r["concurrency"] for r in result.rows] == [1, 4]
    for row in result.rows:
        assert (row["completed"], row["failed"], row["output_throughput"]) == (0, 4, None)
        assert row["errors"] == {"HTTP 500: boom": 4}
    table = markdown_table([result])
    assert "| 4 | - | - | - | - | - | - | - | - | 4 |" in table
    paths = write_report([result], tmp_path, plot=False)
    assert "concurrency 4: 4 of 4 failed: HTTP 500: boom" in paths["md"].read_text()


def test_without_matplotlib_only_the_plot_is_skipped(server, tmp_path, monkeypatch, capsys):
    result = run(server, model="fake-7b", concurrency=(1,), num_prompts=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    paths = write_report([result], tmp_path)
    assert paths["png"] is None and not (tmp_path / "bench_serve.png").exists()
    assert paths["md"].exists() and paths["json"].exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["matplotlib is not installed: no plot written (pip install matplotlib)"]


def test_timeout_counts_as_failure(server):
    row = run(server, model="slow", concurrency=(2,), num_prompts=2, timeout=0.5).rows[0]
    assert row["errors"] == {"timeout after 0.5s": 2}


def test_refused_fields_are_dropped_and_noted(server):
    result = run(server, model="strict", concurrency=(2,), num_prompts=2)
    assert result.rows[0]["completed"] == 2
    assert "ignore_eos" not in server.bodies[-1] and "min_tokens" not in server.bodies[-1]
    assert any("refused ignore_eos" in n for n in result.notes)
    assert result.settings["ignore_eos_sent"] is False


def test_token_counts_from_usage_or_from_chunks(server):
    # Two tokens a chunk: usage says 6, the chunks 3; usage wins.
    row = run(server, model="double", concurrency=(1,), num_prompts=2, output_len=6).rows[0]
    assert (row["mean_output_tokens"], row["output_tokens_from"]) == (6, "usage")
    row = run(server, model="no-usage", concurrency=(1,), num_prompts=2, output_len=4).rows[0]
    assert (row["mean_output_tokens"], row["output_tokens_from"]) == (4, "chunks")
    assert row["input_tokens_from"] == "unknown" and row["input_throughput"] is None


def test_completions_endpoint_and_jsonl(server, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "one two three", "output_len": 5}\n\n{"prompt": "four five"}\n')
    row = run(server, model="fake-7b", endpoint="completions", dataset=str(data), concurrency=(2,),
              num_prompts=4).rows[0]
    assert row["completed"] == 4
    assert [b["prompt"] for b in server.bodies[-4:]] == ["one two three", "four five"] * 2
    assert sorted(b["max_tokens"] for b in server.bodies[-4:]) == [3, 3, 5, 5]
    assert row["mean_input_tokens"] == (3 + 2) / 2 + FIXED


@pytest.mark.parametrize("line, needle", [
    ("{bad", "line 1: not JSON"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"prompt": "a", "output_len": 0}', "positive integer"),
    ('{"messages": [{"role": "user"}]}', "messages[0]"),
    ("[1, 2]", "expected an object"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, needle):
    p = tmp_path / "d.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(UserError) as exc:
        load_jsonl(p, 128, "chat")
    assert needle in str(exc.value)


def test_cli_writes_markdown_json_and_plot(server, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["quantkit", "bench", "serve", server.url + "/v1", "--concurrency", "1,2", "--num-prompts", "2",
            "--input-len", "32", "--output-len", "3", "--output-dir", str(out), "--quiet", "--label", "fake"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "| Batch | Latency/s | Request throughput/s | Input token throughput/s | Output token throughput/s" \
           " | Mean TTFT ms | P99 TTFT ms | Mean TPOT ms | P99 TPOT ms | Failed |" in printed
    md = (out / "bench_serve.md").read_text()
    assert md.count("\n| 1 | ") == 1 and md.count("\n| 2 | ") == 1 and "model fake-7b" in md
    data = json.loads((out / "bench_serve.json").read_text())
    rows = data["runs"][0]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["completed"] == 2 for r in rows)
    assert data["runs"][0]["label"] == "fake"
    png = out / "bench_serve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # An earlier run beside a new one: one table with a Server column.
    monkeypatch.setattr(sys, "argv", ["quantkit", "bench", "serve", server.url, "--concurrency", "1",
                                      "--num-prompts", "1", "--output-len", "2", "--quiet", "--label", "again",
                                      "--compare", str(out / "bench_serve.json"), "-o", str(tmp_path / "o2")])
    with pytest.raises(SystemExit):
        main()
    md2 = (tmp_path / "o2" / "bench_serve.md").read_text()
    assert "| Server | Batch |" in md2 and "| fake | 1 |" in md2 and "| again | 1 |" in md2


@pytest.mark.parametrize("args, needle", [
    (["--concurrency", "1,x"], "--concurrency"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset", "/nonexistent.jsonl"], "no such file"),
    (["--model", "nope-model", "--num-prompts", "1"], None),
])
def test_cli_bad_input_is_one_line(server, tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.setattr(sys, "argv", ["quantkit", "bench", "serve", server.url, "--quiet", "-o", str(tmp_path),
                                      "--concurrency", "1", *args])
    if needle is None:  # the fake answers any model: point at a closed port instead
        monkeypatch.setattr(sys, "argv", ["quantkit", "bench", "serve", "http://127.0.0.1:9", "--quiet",
                                          "-o", str(tmp_path), *args])
        needle = "the first request failed"
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "bench_serve.json").exists()


def test_against_quantkit_serve(qk_server, chat_model_dir):
    """The real server (the suite's shared `quantkit serve` subprocess on a tiny chat model): every
    request completes with exactly output_len tokens (ignore_eos honoured), counted from usage; the
    random prompts are fitted to about input_len tokens, or to exactly input_len with --tokenizer."""
    fitted = bench_serve(BenchServeConfig(url=qk_server.url, concurrency=(1, 4), num_prompts=8, input_len=48,
                                          output_len=8), progress=False)
    exact = bench_serve(BenchServeConfig(url=qk_server.url, concurrency=(4,), num_prompts=4, input_len=48,
                                         output_len=8, tokenizer=str(chat_model_dir)), progress=False)
    assert fitted.settings["ignore_eos_sent"] is True
    for row in fitted.rows + exact.rows:
        assert (row["completed"], row["failed"]) == (row["requests"], 0), row["errors"]
        assert row["mean_output_tokens"] == 8 and row["output_tokens_from"] == "usage"
        assert row["input_tokens_from"] == "usage"
        assert 0 < row["mean_ttft_ms"] <= row["latency_s"] * 1e3 and row["mean_tpot_ms"] > 0
    assert all(40 <= row["mean_input_tokens"] <= 56 for row in fitted.rows)
    assert exact.rows[0]["mean_input_tokens"] == 48
