"""GPU timing helpers for the kernel benchmarks: CUDA-graph replay medians and plain launches.

Every timed call takes its weight from a ring of buffers whose total size is several times the L2
cache, so that no method is timed on weights the cache still holds from the previous call.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

L2_BYTES = 60 * 2**20
RING_BYTES = 4 * L2_BYTES


def ring_size(nbytes: int, floor: int = 2) -> int:
    """How many copies of a weight of `nbytes` make the ring at least RING_BYTES large."""
    return max(floor, -(-RING_BYTES // max(nbytes, 1)))


def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    return 2 * n * 4 / statistics.median(times) / 1e12


def graph_us(calls: list[Callable[[], object]], replays: int = 15, rounds: int = 2) -> float:
    """Median µs per call, timed over CUDA-graph replays of `rounds` passes through `calls`."""
    for fn in calls:  # warm-up: compiles kernels, allocates split-K counters outside the graph
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def plain_us(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Median µs per call over plain (eager) launches of every call in turn."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for fn in calls:
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(calls))
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when out holds NaN or Inf."""
    if not torch.isfinite(out).all():
        return float("inf")
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item()
