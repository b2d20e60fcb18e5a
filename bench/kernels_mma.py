"""The tensor-core GEMV (quantkit/kernels/triton_mma.py) on the GPU: correctness, then a timing sweep.

    PYTHONPATH=. python bench/kernels_mma.py --out DIR [--quick]

Correctness: every configuration family (bits, fp16/bf16, 1–8 column tiles, 1, 2 or 4 tiles per
step, 2, 4 or 8 warps, M up to 64, bias, K not a multiple of 128, N not a multiple of 16) against the
fp32 reference on random weights and inputs, output poisoned with NaN before each run.
Timing: the four Llama-2-7B linears, M in {1, 8, 16, 32, 64} (W4 g128) and {1, 16, 32, 64} (W8 per channel),
every (warps, tiles, register budget) configuration, beside fp16 F.linear and the dispatch's choice,
CUDA-graph replay medians over a ring of weight buffers. Writes DIR/mma.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.kernel_candidates import SHAPES
from bench.kernel_timing import graph_us, rel_err, ring_size
from quantkit.kernels import dispatch, triton_mma
from quantkit.kernels.triton_mma import MmaWeights


def random_mw(k: int, n: int, bits: int, group_size: int) -> MmaWeights:
    """Random weights already in the mma layout."""
    gs = k if group_size == -1 else group_size
    g = -(-k // gs)
    words = -(-k // 128) * 128 * bits // 32 * 16  # per 16-row tile (rows past N are padding)
    return MmaWeights(
        qweight=torch.randint(-(2**31), 2**31 - 1, (-(-n // 16), words), dtype=torch.int32, device="cuda"),
        scales=(torch.rand(n, g, device="cuda") * 0.01 + 0.001).half(),
        zeros=torch.randint(0, 2**bits, (n, g), dtype=torch.uint8, device="cuda"),
        bits=bits, group_size=gs, in_features=k, out_features=n,
    )


def reference(x: torch.Tensor, mw: MmaWeights, bias: torch.Tensor | None) -> torch.Tensor:
    q = triton_mma.unpack_mma(mw.qweight, mw.bits, mw.in_features, mw.out_features).float()
    g = torch.arange(mw.in_features, device=x.device) // mw.group_size
    w = (q - mw.zeros.float()[:, g]) * mw.scales.float()[:, g]
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


def check(quick: bool) -> list[dict]:
    rows = []
    shapes = [(4096, 4096), (1000, 4096), (200, 11008), (136, 320)]
    families = [(4, 128, torch.float16), (4, 128, torch.bfloat16), (8, -1, torch.float16), (4, 256, torch.float16)]
    configs = list(itertools.product((2, 4, 8), ((1, None), (2, 128), (4, 168))))  # warps, (tiles, maxnreg)
    i = 0
    for bits, gs, dtype in families:
        for n, k in shapes:
            mw = random_mw(k, n, bits, gs)
            for m in (1, 3, 8, 9, 16, 17, 33, 64):
                nw, (tiles, maxnreg) = configs[i % len(configs)]
                has_bias = i % 3 == 0
                i += 1
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                try:
                    triton_mma.gemv(x, mw, bias, num_warps=nw, tiles=tiles, maxnreg=maxnreg, out=out)
                    torch.cuda.synchronize()
                    err = rel_err(out, reference(x, mw, bias))
                except Exception as exc:  # report every failure, keep checking the rest
                    err = float("inf")
                    print(f"FAILED {exc!r}"[:300])
                row = dict(bits=bits, group_size=gs, dtype=str(dtype), n=n, k=k, m=m, warps=nw, tiles=tiles,
                           maxnreg=maxnreg, bias=has_bias, rel_err=err)
                rows.append(row)
                flag = "ok" if err <= 1e-2 else "FAIL"
                print(f"{flag} W{bits} g{gs} {dtype} N={n} K={k} M={m} w{nw} t{tiles} r{maxnreg} "
                      f"bias={has_bias}: {err:.2e}", flush=True)
            if quick and n == 1000:
                break
    return rows


def sweep(quick: bool) -> list[dict]:
    """Every configuration of the mma GEMV per shape and M, beside fp16 F.linear and the dispatch's choice."""
    rows = []
    # (warps, tiles per step, maxnreg)
    configs = [(4, 1, None), (8, 1, None), (4, 2, None), (8, 2, 128), (4, 1, 128), (2, 1, None), (4, 4, 168)]
    if quick:
        configs = configs[:2]
    for bits, ms in ((4, (1, 8, 16, 32, 64)), (8, (1, 16, 32, 64))):
        gs = 128 if bits == 4 else -1
        for shape, (k, n) in SHAPES.items():
            first = random_mw(k, n, bits, gs)
            ring = [first] + [random_mw(k, n, bits, gs) for _ in range(ring_size(first.nbytes) - 1)]
            fp16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(ring_size(n * k * 2))]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                base = {"shape": shape, "bits": bits, "m": m}
                t16 = graph_us([lambda w=w: F.linear(x, w) for w in fp16])
                choice = dispatch.mma_choice(bits, m, n)
                told = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
                best = None
                for nw, tiles, maxnreg in configs:
                    try:
                        us = graph_us([lambda mw=mw: triton_mma.gemv(x, mw, num_warps=nw, tiles=tiles, maxnreg=maxnreg)
                                       for mw in ring])
                    except Exception as exc:
                        print(f"FAILED W{bits} {shape} M={m} w{nw} t{tiles}: {exc!r}"[:300])
                        continue
                    tbps = first.nbytes / us / 1e6
                    rows.append({**base, "warps": nw, "tiles": tiles, "maxnreg": maxnreg, "us": us, "tbps": tbps,
                                 "fp16_us": t16, "now_us": told, "now": choice.method})
                    if best is None or us < best[0]:
                        best = (us, nw, tiles, tbps, maxnreg)
                print(f"W{bits} {shape:7} M={m:2}: fp16 {t16:6.1f} | now {told:6.1f} ({choice.method}) | best "
                      f"{best[0]:6.1f} us w{best[1]} t{best[2]} r{best[4]} {best[3]:.2f} TB/s "
                      f"-> x{t16 / best[0]:.2f} fp16",
                      flush=True)
            del ring, fp16
            torch.cuda.empty_cache()
    return rows


@triton.jit
def _empty_kernel(out_ptr):
    if tl.program_id(0) == 0:
        tl.store(out_ptr, 1.0)


def floor() -> list[dict]:
    """Time against K at fixed N: the intercept is what a launch costs beyond streaming the weights."""
    rows = []
    dummy = torch.empty(1, device="cuda")
    rows.append({"what": "empty triton kernel (256 programs)",
                 "us": graph_us([lambda: _empty_kernel[(256,)](dummy)] * 8)})
    print(f"empty kernel {rows[-1]['us']:.2f} us", flush=True)
    for n in (4096, 12288):
        for k in (128, 512, 1024, 2048, 4096):
            ring = [random_mw(k, n, 4, 128) for _ in range(ring_size(n * k // 2))]
            fp16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(ring_size(n * k * 2))]
            x = torch.randn(1, k, device="cuda", dtype=torch.float16)
            row = {"n": n, "k": k, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            for nw in (4, 8):
                row[f"mma_w{nw}_us"] = graph_us([lambda mw=mw: triton_mma.gemv(x, mw, num_warps=nw) for mw in ring])
            rows.append(row)
            print(row, flush=True)
            del ring, fp16
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for mma.json")
    ap.add_argument("--quick", action="store_true", help="fewer checks and configurations")
    ap.add_argument("--skip-check", action="store_true", help="timing only")
    ap.add_argument("--skip-sweep", action="store_true", help="checks only")
    ap.add_argument("--floor", action="store_true", help="only the time-against-K series (launch floor)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.floor:
        res["floor"] = floor()
        (args.out / "floor.json").write_text(json.dumps(res, indent=1))
        return
    if not args.skip_check:
        res["check"] = check(args.quick)
        bad = [r for r in res["check"] if not r["rel_err"] <= 1e-2]
        print(f"checks: {len(res['check'])}, failures {len(bad)}, worst "
              f"{max(r['rel_err'] for r in res['check']):.2e} ({time.time() - t0:.0f} s)", flush=True)
    if not args.skip_sweep:
        res["sweep"] = sweep(args.quick)
    (args.out / "mma.json").write_text(json.dumps(res, indent=1))
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
