"""How fast can any one kernel read a W4 / W8 layer's bytes? The floor under the M = 1 targets (H200).

    PYTHONPATH=. python bench/probes/read_floor.py --out DIR

A read-only Triton kernel (16-byte loads, `unroll` loads in flight per thread, XOR-reduced so that
nothing is optimised away, one int32 written per program) streams exactly the bytes of each
Llama-2-7B layer's packed weights, scales and zeros (one flat buffer of that size), in the same
CUDA-graph timing as bench/kernel_speed.py (median over replays, a ring of buffers several times the L2
size). Every configuration below is timed and the fastest is the floor; beside it, in the same run,
fp16 F.linear and our dispatched kernel at M = 1. Also read-only times over a range of sizes, for
the intercept (µs at no bytes) and the marginal rate (TB/s) of a single launch.

Writes DIR/read_floor.json.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.lib.kernel_timing import copy_bandwidth, graph_us, ring_size
from bench.lib.kernels_mma import _rings
from quantkit.kernels import dispatch

# (num_warps, unroll): loads in flight per thread = unroll, bytes per program step = nw·32·16·unroll
CONFIGS = [(nw, u) for nw in (4, 8, 16) for u in (1, 2, 4, 8)]
# programs as a multiple of the SM count (persistent, grid-stride) or 0 = one program per chunk
GRIDS = (0, 2, 4, 8)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def read_kernel(src, out, n_vec, steps, UNROLL: tl.constexpr, BLOCK: tl.constexpr):
    """XOR of every int32 in src[: n_vec * 4]; program p reads `steps` steps of UNROLL × BLOCK vectors,
    either one contiguous chunk (stride 0 → chunked) or grid-strided."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)[:, None] * 4 + tl.arange(0, 4)[None, :]
    acc = tl.zeros([BLOCK, 4], tl.int32)
    step_vecs = UNROLL * BLOCK
    for s in range(steps):
        base = (s * nprog + pid) * step_vecs
        for u in tl.static_range(UNROLL):
            v = base + u * BLOCK
            offs = v * 4 + lane
            acc ^= tl.load(src + offs, mask=offs < n_vec * 4, other=0, cache_modifier=".cg")
    tl.store(out + pid, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


def read_call(buf: torch.Tensor, out: torch.Tensor, nw: int, unroll: int, grid_mult: int, sms: int):
    n_vec = buf.numel() // 4
    block = nw * 32
    step = unroll * block
    total_steps = triton.cdiv(n_vec, step)
    progs = total_steps if grid_mult == 0 else min(total_steps, grid_mult * sms)
    steps = triton.cdiv(total_steps, progs)
    return lambda: read_kernel[(progs,)](buf, out, n_vec, steps, UNROLL=unroll, BLOCK=block, num_warps=nw)


def reads_everything(buf: torch.Tensor, nw: int, unroll: int, grid_mult: int, sms: int) -> bool:
    """The kernel's XOR over its programs equals the XOR of every word: nothing skipped."""
    out = torch.zeros(1 << 20, dtype=torch.int32, device=buf.device)
    read_call(buf, out, nw, unroll, grid_mult, sms)()
    return bool(np.bitwise_xor.reduce(out.cpu().numpy()) == np.bitwise_xor.reduce(buf.cpu().numpy()))


def best_read(nbytes: int, sms: int) -> dict:
    """The fastest configuration's µs and TB/s for reading nbytes (a ring of buffers)."""
    ring = [torch.randint(-(2**31), 2**31 - 1, (-(-nbytes // 16) * 4,), dtype=torch.int32, device="cuda")
            for _ in range(ring_size(nbytes))]
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    best = None
    for nw, unroll in CONFIGS:
        for gm in GRIDS:
            us = graph_us([read_call(b, out, nw, unroll, gm, sms) for b in ring])
            if best is None or us < best["us"]:
                best = {"us": us, "num_warps": nw, "unroll": unroll, "grid": gm}
    best["checked"] = reads_everything(ring[0], best["num_warps"], best["unroll"], best["grid"], sms)
    del ring
    best["tbps"] = nbytes / best["us"] / 1e6
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for read_floor.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.2f} TB/s")
    result = {"gpu": torch.cuda.get_device_name(), "copy_tbps": copy, "sizes": [], "shapes": []}
    for mb in (0.25, 1, 4, 8, 16, 32, 64):
        r = best_read(int(mb * 1e6), sms)
        r["mb"] = mb
        result["sizes"].append(r)
        print(f"read {mb:6.2f} MB: {r['us']:7.2f} us {r['tbps']:.2f} TB/s  {r}", flush=True)
    for bits, _, shape, k, n, ring, fp16 in _rings(((4, (1,)), (8, (1,)))):
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        fp16_us = graph_us([lambda w=w, x=x: F.linear(x, w) for w in fp16])
        nbytes = ring[0].nbytes
        choice = dispatch.choice_for(ring[0], 1, x.device, graphed=True)
        ours = graph_us([lambda w=w, x=x, c=choice: dispatch.run(x, w, None, c) for w in ring])
        del ring[1:], fp16[:]  # room for the read kernel's own ring
        floor = best_read(nbytes, sms)
        row = {"shape": shape, "bits": bits, "bytes": nbytes, "fp16_us": fp16_us, "ours_us": ours,
               "ours_tbps": nbytes / ours / 1e6, "read": floor,
               "ours_pct_of_read": 100 * floor["us"] / ours,
               "speedup": fp16_us / ours, "speedup_bound": fp16_us / floor["us"]}
        result["shapes"].append(row)
        print(f"{shape:8} W{bits} {nbytes / 1e6:6.2f} MB fp16 {fp16_us:6.2f} ours {ours:6.2f} "
              f"({row['ours_tbps']:.2f} TB/s, {row['speedup']:.2f}x) read floor {floor['us']:6.2f} "
              f"({floor['tbps']:.2f} TB/s, bound {row['speedup_bound']:.2f}x fp16) ours = "
              f"{row['ours_pct_of_read']:.0f}% of the read floor  cfg {floor}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "read_floor.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
