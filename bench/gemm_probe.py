"""Probe of the tensor-core GEMM on the mma layout (quantkit/kernels/triton_mma_gemm.py) for M ≥ 32.

    PYTHONPATH=. python bench/gemm_probe.py --out DIR [--ms 32,64,128,256,1024] [--bits 4,8]

For each Llama-2-7B linear and M: fp16 F.linear, today's dispatch (mma GEMV up to 64, dequantize +
cuBLAS above), dequantize + cuBLAS, and every configuration of CONFIGS (block_n, block_m, warps,
stages), CUDA-graph medians over a ring of weights several times the L2. Each configuration is first
checked against the fp32 reference on a NaN-poisoned output at M = 77 and 300 (rows past the tiles).
The kernels are compiled by a pool of processes first. Writes DIR/gemm_probe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernel_timing import graph_us, rel_err
from bench.kernels_mma import _rings, random_mw, reference
from quantkit.kernels import dispatch, triton_mma_gemm

# block_n (W rows), block_m (x rows), warps, stages
CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (64, 128, 4, 3),
           (128, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3), (128, 256, 8, 2)]


def _kw(cfg: tuple) -> dict:
    bn, bm, w, s = cfg
    return dict(block_n=bn, block_m=bm, num_warps=w, num_stages=s)


def _compile_one(job: tuple) -> str:
    bits, cfg = job
    try:
        mw = random_mw(4096, 256, bits, 128 if bits == 4 else -1)
        x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
        triton_mma_gemm.gemm(x, mw, **_kw(cfg))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:
        return f"{job}: {exc!r}"[:300]


def precompile(bits: list[int], workers: int = 15) -> None:
    import multiprocessing as mp

    t0 = time.time()
    jobs = [(b, c) for b in bits for c in CONFIGS]
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_one, jobs, chunksize=1) if e]
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f} s, {len(errors)} failed", flush=True)
    for e in errors:
        print("  " + e, flush=True)


def check(bits: list[int]) -> list[dict]:
    rows = []
    for b in bits:
        mw = random_mw(4096, 1000, b, 128 if b == 4 else -1)
        bias = torch.randn(1000, device="cuda", dtype=torch.float16)
        for m in (77, 300):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
            ref = reference(x, mw, bias)
            for cfg in CONFIGS:
                out = torch.full((m, 1000), float("nan"), device="cuda", dtype=torch.float16)
                try:
                    triton_mma_gemm.gemm(x, mw, bias, out=out, **_kw(cfg))
                    err = rel_err(out.float(), ref)
                except Exception as exc:
                    err = repr(exc)[:200]
                rows.append({"bits": b, "m": m, "cfg": cfg, "err": err})
    bad = [r for r in rows if not isinstance(r["err"], float) or r["err"] > 1e-2]
    worst = max((r["err"] for r in rows if isinstance(r["err"], float)), default=float("nan"))
    print(f"check: {len(rows)} cases, {len(bad)} failures, worst {worst:.2e}", flush=True)
    for r in bad:
        print("  FAIL", r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for gemm_probe.json")
    ap.add_argument("--ms", default="32,64,128,256,1024", help="rows of x")
    ap.add_argument("--bits", default="4,8", help="weight bits to probe")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    precompile(bits)
    result = {"check": check(bits), "rows": []}
    for b, _, shape, k, n, ring, fp16 in _rings([(b, ms) for b in bits]):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = {"bits": b, "shape": shape, "m": m, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            choice = dispatch.mma_choice(b, m, n)
            row["dispatch_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            row["dequant_cublas_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, dispatch._CUBLAS)
                                                 for mw in ring])
            for cfg in CONFIGS:
                try:
                    row[str(cfg)] = graph_us([lambda mw=mw, cfg=cfg: triton_mma_gemm.gemm(x, mw, **_kw(cfg))
                                              for mw in ring])
                except Exception as exc:
                    row[str(cfg)] = repr(exc)[:100]
            best = min((v, c) for c, v in row.items() if c.startswith("(") and isinstance(v, float))
            result["rows"].append(row)
            print(f"W{b} {shape:7} M={m:4} fp16 {row['fp16_us']:6.1f} dispatch {row['dispatch_us']:6.1f} "
                  f"dq+cublas {row['dequant_cublas_us']:6.1f} best gemm {best[0]:6.1f} {best[1]} "
                  f"-> {row['fp16_us'] / best[0]:.2f}x fp16 (dispatch {row['fp16_us'] / row['dispatch_us']:.2f}x)",
                  flush=True)
        (args.out / "gemm_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
