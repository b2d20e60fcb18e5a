"""`bench.soak`'s report: each request's outcome, the figures of the run, the targets it missed, the table."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

from bench.lib.soak_client import Result
from bench.lib.soak_server import metric

GRACE_S = 5.0   # a server error this long after the server answered again still belongs to the kill
UNEXPECTED = ("unexpected-4xx", "invalid-accepted", "5xx-unexpected", "failed")


@dataclass
class Kill:
    at_s: float
    pid: Optional[int] = None
    recovery_s: Optional[float] = None   # from the kill to the first 200
    note: str = ""


@dataclass
class SoakReport:
    settings: dict
    duration_s: float
    outcomes: dict[str, int]
    by_name: dict[str, dict[str, int]]   # request name → outcome → count
    examples: list[str]                  # the first unexpected answers
    latency_p50_s: Optional[float]
    latency_p99_s: Optional[float]
    engine_restarts: Optional[int]       # from /metrics quantkit_engine_restarts_total, if exported
    rss_mib: tuple[Optional[float], Optional[float]]
    rss_drift_pct: Optional[float]
    gpu_mib: tuple[Optional[float], Optional[float]]
    gpu_drift_pct: Optional[float]
    kv_blocks_used_end: Optional[int]
    in_flight_end: Optional[int]
    kills: list[Kill] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def classify(r: Result, windows: list[tuple[float, float]]) -> str:
    """One result's outcome; `windows`: the spans (seconds into the run) while the engine was restarting."""
    if r.status is not None and 400 <= r.status < 500:
        return "expected-4xx" if r.kind == "invalid" else "unexpected-4xx"
    if r.server_error:
        restarting = any(a <= r.ended <= b for a, b in windows)
        named = r.retry_after or "engine" in r.message.lower()
        return "5xx-expected" if restarting and named else "5xx-unexpected"
    if r.kind == "invalid":
        return "invalid-accepted" if r.status is not None else "failed"
    if r.complete:
        return "ok-disconnected" if r.kind == "leave" else "ok"
    return "failed"


def summarize(settings: dict, results: list[Result], kills: list[Kill], elapsed: float, before: dict, after: dict,
              rss: tuple, gpu: tuple) -> SoakReport:
    """The report of a run: its results, kills, /metrics before and after, memory (start, end) in MiB."""
    windows = [(k.at_s, k.at_s + (k.recovery_s if k.recovery_s is not None else float("inf")) + GRACE_S)
               for k in kills if k.pid is not None]
    outcomes = [classify(r, windows) for r in results]
    by_name: dict[str, Counter] = defaultdict(Counter)
    for r, o in zip(results, outcomes):
        by_name[f"{r.kind}:{r.name}"][o] += 1
    latencies = [r.latency for r, o in zip(results, outcomes) if o == "ok"]
    restarts = [metric(m, "quantkit_engine_restarts_total") for m in (before, after)]
    blocks, in_flight = (metric(after, f"quantkit_{n}") for n in ("kv_blocks_used", "num_requests_in_flight"))
    rep = SoakReport(
        settings=settings, duration_s=round(elapsed, 1), outcomes=dict(Counter(outcomes).most_common()),
        by_name={k: dict(v) for k, v in sorted(by_name.items())},
        examples=[f"{r.ended:.1f} s {r.kind}:{r.name}: {o}, {r.status or 'no status'} {r.message}"[:300]
                  for r, o in zip(results, outcomes) if o in UNEXPECTED][:10],
        latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
        engine_restarts=None if None in restarts else int(restarts[1] - restarts[0]),
        rss_mib=rss, rss_drift_pct=drift(*rss), gpu_mib=gpu, gpu_drift_pct=drift(*gpu),
        kv_blocks_used_end=None if blocks is None else int(blocks),
        in_flight_end=None if in_flight is None else int(in_flight), kills=kills)
    rep.failures = missed(rep)
    return rep


def missed(rep: SoakReport) -> list[str]:
    """The targets the run missed, one sentence each (the limits are in rep.settings)."""
    s, out = rep.settings, []
    for outcome in UNEXPECTED:
        if rep.outcomes.get(outcome):
            names = sorted(k for k, v in rep.by_name.items() if v.get(outcome))
            out.append(f"{rep.outcomes[outcome]} {outcome} ({', '.join(names)})")
    if rep.kv_blocks_used_end:
        out.append(f"{rep.kv_blocks_used_end} KV blocks still in use {s['idle_wait_s']:g} s after the traffic "
                   f"stopped ({rep.in_flight_end} requests in flight)")
    if rep.rss_drift_pct is not None and rep.rss_drift_pct > s["max_rss_drift"]:
        out.append(f"RSS drift {rep.rss_drift_pct:+.2f} % (target ≤ {s['max_rss_drift']:g} %)")
    for k in rep.kills:
        if k.recovery_s is None:
            out.append(f"kill at {k.at_s:g} s: {k.note}")
        elif k.recovery_s > s["max_recovery_s"]:
            out.append(f"kill at {k.at_s:g} s: answered again after {k.recovery_s:g} s "
                       f"(target ≤ {s['max_recovery_s']:g} s)")
    return out


def percentile(values: list[float], q: int) -> Optional[float]:
    if len(values) < 2:
        return round(values[0], 4) if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 4)


def drift(start: Optional[float], end: Optional[float]) -> Optional[float]:
    """Percent change from start to end; None when either is unknown."""
    return None if not start or end is None else round((end / start - 1) * 100, 3)


def table(rep: SoakReport) -> str:
    """The report as a Markdown table, then the unexpected answers and the missed targets."""
    def na(v) -> str:
        return "n/a" if v is None else str(v)

    def mib(pair: tuple, pct: Optional[float]) -> str:
        return "n/a" if pct is None else f"{pair[0]:,.0f} → {pair[1]:,.0f} MiB ({pct:+.2f} %)"

    total = sum(rep.outcomes.values())
    rows = [("requests", f"{total} in {rep.duration_s:g} s at concurrency {rep.settings['concurrency']}")]
    rows += [(o, str(n)) for o, n in rep.outcomes.items()]
    rows += [("latency p50 / p99 (ok)", f"{na(rep.latency_p50_s)} / {na(rep.latency_p99_s)} s"),
             ("engine restarts", na(rep.engine_restarts)),
             ("RSS, server + children", mib(rep.rss_mib, rep.rss_drift_pct)),
             ("GPU memory", mib(rep.gpu_mib, rep.gpu_drift_pct)),
             ("KV blocks in use at the end", na(rep.kv_blocks_used_end))]
    rows += [(f"engine killed at {k.at_s:g} s (pid {k.pid})",
              f"answering again after {k.recovery_s:g} s" if k.recovery_s is not None else k.note) for k in rep.kills]
    lines = ["| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    lines += [f"unexpected: {e}" for e in rep.examples]
    lines += [f"TARGET MISSED: {f}" for f in rep.failures] or ["all targets met"]
    return "\n".join(lines)
