"""GET /metrics: the server's counters and the engine's state in the Prometheus text format.

Counters and histograms are updated on the event loop's thread only (where requests start and
outputs arrive); the engine's gauges (running and waiting sequences, KV blocks, prefix-cache hits)
are read from `Engine.stats()` when scraped.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Iterable

PREFIX = "quantkit"
# Seconds; the buckets cover a CPU test model's milliseconds to a long queue's minute.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2,
                0.5, 1.0, 2.5)


class Histogram:
    """A cumulative Prometheus histogram over fixed bucket bounds."""

    def __init__(self, name: str, help: str, bounds: Iterable[float]) -> None:
        self.name, self.help, self.bounds = name, help, tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)   # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum!r}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """What the HTTP side counts: requests by endpoint and outcome, tokens, TTFT and TPOT."""

    def __init__(self) -> None:
        self.requests = Counter()          # (endpoint, status class or finish reason) → count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected_queue_full = 0
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from a request's arrival to its first output token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per finished request.",
                              TPOT_BUCKETS)

    def render(self, engine_stats: dict, in_flight: int, engine_restarts: int = 0, engine_up: bool = True) -> str:
        s = engine_stats
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, value, labels: str = "") -> None:
            full = f"{PREFIX}_{name}"
            lines.extend([f"# HELP {full} {help}", f"# TYPE {full} {kind}", f"{full}{labels} {value}"])

        metric("engine_up", "gauge", "1 while the engine serves, 0 while it restarts or after it failed.",
               int(engine_up))
        metric("engine_restarts_total", "counter", "Engine restarts after a crash or a hang.", engine_restarts)
        metric("num_requests_running", "gauge", "Sequences in the engine's running batch.", s["running"])
        metric("num_requests_waiting", "gauge", "Sequences waiting for a batch slot or KV blocks.", s["waiting"])
        metric("num_requests_in_flight", "gauge", "Sequences accepted by the server and not yet finished.",
               in_flight)
        metric("kv_blocks_used", "gauge", "KV-cache blocks held by sequences.", s["kv_blocks_used"])
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", s["kv_blocks_total"])
        metric("kv_cache_usage_ratio", "gauge", "Fraction of the KV pool held by sequences.",
               round(s["kv_blocks_used"] / max(s["kv_blocks_total"], 1), 6))
        metric("prefix_cache_queries_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
               s["prefix_cache_queries"])
        metric("prefix_cache_hits_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
               s["prefix_cache_hits"])
        metric("prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries, in tokens, since the start.",
               round(s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1), 6))
        metric("num_preemptions_total", "counter", "Sequences preempted for KV blocks (recomputed later).",
               s["preemptions"])
        metric("kernel_compiles_after_start_total", "counter", "Kernel specializations compiled after the engine "
               "was ready (a step shape the start-up warm-up missed; each cost a request its time).",
               s.get("kernel_compiles_after_start", 0))
        metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Output tokens sent.", self.generation_tokens)
        metric("requests_rejected_queue_full_total", "counter", "Requests answered 429 (queue full).",
               self.rejected_queue_full)
        name = f"{PREFIX}_requests_total"
        lines += [f"# HELP {name} Finished sequences by endpoint and finish reason.", f"# TYPE {name} counter"]
        for (endpoint, reason), n in sorted(self.requests.items()):
            lines.append(f'{name}{{endpoint="{endpoint}",finish_reason="{reason}"}} {n}')
        lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"
