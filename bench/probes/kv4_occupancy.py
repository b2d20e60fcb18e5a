"""Issue #38: why KV4 decodes no faster than KV8 at b32 × 4k (Llama-2-7B shape, MHA: the "rows" kernel).

    PYTHONPATH=. python3 bench/probes/kv4_occupancy.py [--out F]

Nsight Compute (2026-12-06, H100) showed both formats at 255 registers per thread, 12.5 % theoretical
occupancy (2-warp programs), KV8 at 70 % of DRAM bandwidth and KV4 at 33 %: KV4 reads half the bytes but
has too few loads in flight to hide their latency. This times the rows kernel per KV format with the
registers capped (`maxnreg`: more programs resident per SM), tile sizes, warps and partitions, CUDA-graph
median µs per layer and the effective TB/s of KV bytes read, and the max |Δ| against the default launch.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import itertools
import json

import torch

from bench.probes.paged_attention import graph_time, setup
from quantkit.kernels import triton_paged
from quantkit.kernels.paged_kv import PagedKV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    batch, ctx, shape = 32, 4096, "llama2-7b"
    for bits in (8, 4):
        q, cache, tables, lens, _ = setup(shape, batch, ctx, bits, 4096)
        read = batch * ctx * PagedKV.bytes_per_token(32, 128, bits, torch.float16)
        call = lambda **cfg: triton_paged.paged_decode_attention(q, cache, tables, lens, 128**-0.5,  # noqa: E731
                                                                 kernel="rows", **cfg)
        base = call()
        for regs, (n, w), p in itertools.product((None, 128, 96, 64), ((128, 2), (64, 2), (64, 4), (32, 2), (32, 4)),
                                                 (None, 4, 8)):
            cfg = dict(maxnreg=regs, block_n=n, num_warps=w, partitions=p)
            try:
                diff = (call(**cfg).float() - base.float()).abs().max().item()
                us = graph_time(lambda: call(**cfg))
            except Exception as exc:
                print(f"kv{bits} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append(dict(bits=bits, **cfg, us=round(us, 1), tb_s=round(read / us / 1e6, 3), max_abs_diff=diff))
            print(f"kv{bits} regs {regs or '-':>4} n{n:<4} w{w} p{p or '-':<2} {us:8.1f} µs {read / us / 1e6:6.2f} TB/s"
                  f" Δ{diff:.1e}", flush=True)
        del q, cache, tables, lens
        torch.cuda.empty_cache()
    best = {b: min((r for r in rows if r["bits"] == b), key=lambda r: r["us"]) for b in (8, 4)}
    print("best:", json.dumps(best))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
