"""GET /metrics: Prometheus text whose counters move by what the requests did: tokens in and out, TTFT
and TPOT observations, finish reasons, prefix-cache hits, the KV pool's size and use."""

from __future__ import annotations

import requests

from quantkit.server.metrics import Histogram
from quantkit_testing.serve_process import wait_idle


def test_histogram_is_cumulative():
    h = Histogram("x_seconds", "a test histogram", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    lines = h.render()
    assert lines[:2] == ["# HELP x_seconds a test histogram", "# TYPE x_seconds histogram"]
    assert lines[2:] == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1.0"} 3',
                         'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 2.65", "x_seconds_count 4"]


def test_metrics_follow_the_requests(qk_server, chat_tokenizer):
    r = requests.get(qk_server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = wait_idle(qk_server.url)
    assert before["quantkit_kv_blocks_total"] == 4096 // 16     # --num-kv-tokens 4096, 16-token blocks
    # A prompt of several full blocks, sent twice: the second finds them in the prefix cache.
    prompt = "the model quantizes weights into groups of integers and a scale per group " * 4
    ids = chat_tokenizer(prompt)["input_ids"]
    assert len(ids) > 48
    for max_tokens in (5, 3):
        out = requests.post(qk_server.url + "/v1/completions", timeout=60,
                            json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == max_tokens
    after = wait_idle(qk_server.url)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("quantkit_prompt_tokens_total") == 2 * len(ids)
    assert delta("quantkit_generation_tokens_total") == 8
    assert delta('quantkit_requests_total{endpoint="completions",finish_reason="length"}') == 2
    assert delta("quantkit_time_to_first_token_seconds_count") == 2
    assert delta("quantkit_time_per_output_token_seconds_count") == 2
    assert delta("quantkit_time_to_first_token_seconds_sum") > 0
    assert delta('quantkit_time_to_first_token_seconds_bucket{le="+Inf"}') == 2
    # Every prompt token is looked up; the second request finds its full blocks but the last one.
    assert delta("quantkit_prefix_cache_queries_tokens_total") == 2 * len(ids)
    assert delta("quantkit_prefix_cache_hits_tokens_total") >= (len(ids) - 1) // 16 * 16
    assert 0 < after["quantkit_prefix_cache_hit_rate"] <= 1
    assert after["quantkit_kv_blocks_used"] == 0 and after["quantkit_kv_cache_usage_ratio"] == 0
