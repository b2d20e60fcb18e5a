"""The tensor-core GEMV (quantkit/kernels/triton_mma.py) on the GPU: correctness, then a timing sweep.

    PYTHONPATH=. python bench/lib/kernels_mma.py --out DIR [--quick]

Correctness: every configuration family (bits, fp16/bf16, 1–8 column tiles, 1, 2 or 4 tiles per
step, 2, 4 or 8 warps, M up to 64, bias, K not a multiple of 128, N not a multiple of 16) against the
fp32 reference on random weights and inputs, output poisoned with NaN before each run.
Timing: the four Llama-2-7B linears, M in {1, 8, 16, 32, 64} (W4 g128) and {1, 16, 32, 64} (W8 per channel),
every (warps, tiles, row tiles, register budget) configuration of CONFIGS, beside fp16 F.linear and
the dispatch's choice, CUDA-graph replay medians over a ring of weight buffers. The kernels are
compiled first by a pool of processes (Triton's on-disk cache then serves the timed process).
Writes DIR/mma.json.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.lib.kernel_candidates import SHAPES
from bench.lib.kernel_timing import graph_us, rel_err, ring_size
from quantkit.kernels import dispatch, triton_mma
from quantkit.kernels.triton_mma import MmaWeights
from bench.lib.common import use_test_helpers

use_test_helpers()
from quantkit_testing.mma_layers import mma_codes  # noqa: E402


def random_mw(k: int, n: int, bits: int, group_size: int) -> MmaWeights:
    """Random weights already in the mma layout."""
    gs = k if group_size == -1 else group_size
    g = -(-k // gs)
    words = -(-k // 128) * 128 * bits // 32 * 16  # per 16-row tile (rows past N are padding)
    row_tiles = -(-n // (16 * triton_mma.ROW_TILES_MAX)) * triton_mma.ROW_TILES_MAX
    return MmaWeights(
        qweight=torch.randint(-(2**31), 2**31 - 1, (row_tiles, words), dtype=torch.int32, device="cuda"),
        scales=(torch.rand(n, g, device="cuda") * 0.01 + 0.001).half(),
        zeros=torch.randint(0, 2**bits, (n, g), dtype=torch.uint8, device="cuda"),
        bits=bits, group_size=gs, in_features=k, out_features=n,
    )


def reference(x: torch.Tensor, mw: MmaWeights, bias: torch.Tensor | None) -> torch.Tensor:
    q = mma_codes(mw.qweight, mw.bits, mw.in_features, mw.out_features).float()
    g = torch.arange(mw.in_features, device=x.device) // mw.group_size
    w = (q - mw.zeros.float()[:, g]) * mw.scales.float()[:, g]
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


def _check_cases(quick: bool) -> list[tuple]:
    shapes = [(4096, 4096), (1000, 4096), (200, 11008), (136, 320)]
    families = [(4, 128, "float16"), (4, 128, "bfloat16"), (8, -1, "float16"), (4, 256, "float16")]
    # warps, (tiles, row tiles, maxnreg, row groups, split-K)
    configs = list(itertools.product((2, 4, 8), ((1, 1, None, 1, 1), (2, 1, 128, 2, 3), (4, 1, 168, 1, 2),
                                                 (1, 2, None, 2, 1), (2, 4, 168, 1, 4), (1, 4, None, 2, 8))))
    cases, i = [], 0
    for bits, gs, dtype in families:
        for n, k in shapes:
            for m in (1, 3, 8, 9, 16, 17, 33, 64):
                cases.append((bits, gs, dtype, n, k, m, configs[i % len(configs)], i % 3 == 0, i))
                i += 1
            if quick and n == 1000:
                break
    return cases


def _check_case(case: tuple) -> dict:
    """One configuration against the fp32 reference (in a pool process: the cases compile in parallel)."""
    bits, gs, dtype_name, n, k, m, (nw, (tiles, nrows, maxnreg, wr, split)), has_bias, seed = case
    dtype = getattr(torch, dtype_name)
    pdl = seed % 4 == 1
    torch.manual_seed(seed)
    mw = random_mw(k, n, bits, gs)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    error = ""
    try:
        triton_mma.gemv(x, mw, bias, num_warps=nw, tiles=tiles, rows=nrows, maxnreg=maxnreg, warps_n=wr,
                        split_k=split, pdl=pdl, prefetch=seed % 3, out=out)
        torch.cuda.synchronize()
        err = rel_err(out, reference(x, mw, bias))
    except Exception as exc:  # report every failure, keep checking the rest
        err, error = float("inf"), f"{exc!r}"[:300]
    return dict(bits=bits, group_size=gs, dtype=dtype_name, n=n, k=k, m=m, warps=nw, tiles=tiles, rows=nrows,
                maxnreg=maxnreg, warps_n=wr, split_k=split, pdl=pdl, bias=has_bias, rel_err=err, error=error)


def check(quick: bool, workers: int = 15) -> list[dict]:
    """Every configuration family (module docstring) against the reference, NaN-poisoned outputs."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers) as pool:
        rows = pool.map(_check_case, _check_cases(quick), chunksize=1)
    for r in rows:
        flag = "ok" if r["rel_err"] <= 1e-2 else "FAIL"
        print(f"{flag} W{r['bits']} g{r['group_size']} {r['dtype']} N={r['n']} K={r['k']} M={r['m']} w{r['warps']} "
              f"t{r['tiles']} rows{r['rows']} r{r['maxnreg']} wr{r['warps_n']} s{r['split_k']} pdl={r['pdl']} "
              f"bias={r['bias']}: "
              f"{r['rel_err']:.2e} {r['error']}")
    return rows


# (warps, tiles per step, row tiles per warp, maxnreg, row groups, split-K) by column tiles of x (M ≤ 8,
# 16, 32, 64). Row groups 1 and no split: the configurations of runs 27 and 34; then programs whose
# warps form row groups (so that they read each x tile together, from L1) with split-K across programs
# to keep the GPU full. Row tiles 4 only where they compile without spills (ptxas, Triton 3.6, on the
# CPU before the run).
_BASE = {
    1: [(4, 1, 1, None), (8, 1, 1, None), (4, 2, 1, None), (8, 2, 1, 128), (4, 1, 1, 128), (2, 1, 1, None),
        (4, 1, 2, None), (8, 1, 2, None), (2, 1, 2, None)],
    2: [(4, 1, 1, None), (8, 1, 1, None), (4, 2, 1, None), (8, 2, 1, 128), (2, 1, 1, None),
        (4, 1, 2, None), (8, 1, 2, None), (2, 1, 2, None), (4, 2, 2, None), (4, 1, 4, None), (2, 1, 4, None)],
    4: [(4, 1, 1, None), (8, 1, 1, None), (2, 1, 1, None), (4, 1, 1, 128),
        (4, 1, 2, None), (8, 1, 2, None), (2, 1, 2, None)],
    8: [(4, 1, 1, None), (4, 2, 1, None), (2, 1, 1, None), (8, 1, 1, None),
        (4, 1, 2, None), (8, 1, 2, None), (2, 1, 2, None)],
}
CONFIGS = {
    cols: [c + (1, 1) for c in base]
    + [(nw, 1, rows, None, wr, split) for nw in (4, 8) for wr in sorted({2, nw}) for rows in (1, 2, 4)
       for split in (1, 2, 4, 8) if rows < 4 or cols <= 2]
    for cols, base in _BASE.items()
}
SWEEP = ((4, (1, 8, 16, 32, 64)), (8, (1, 16, 32, 64)))


def _cols(m: int) -> int:
    return 1 << max(0, (triton.cdiv(m, 8) - 1).bit_length())


def _sweep_kwargs(m: int, quick: bool) -> list[dict]:
    return [dict(num_warps=nw, tiles=t, rows=r, maxnreg=mx, warps_n=wr, split_k=split)
            for nw, t, r, mx, wr, split in CONFIGS[_cols(m)][: 2 if quick else None]]


def _probe_variants(bits: int, m: int, n: int) -> list[tuple[str, dict]]:
    p = dict(dispatch.mma_choice(bits, m, n).params)
    variants = [("choice", p)] + [(name, {**p, **kw}) for name, kw in PROBE]
    return variants + [(f"w{kw['num_warps']}t{kw['tiles']}m{kw['maxnreg']}s{kw['split_k']}", kw)
                       for kw in PROBE_EXTRA.get(_cols(m), [])]


def _compile_jobs(quick: bool, probing: bool) -> list[tuple]:
    """One small launch per (bits, K, M, configuration): the same specialization as the timed calls
    (split-K 2, 4 and 8 share one kernel)."""
    jobs = []
    for bits, ms in PROBE_SWEEP if probing else SWEEP:
        for k, n in sorted(set(SHAPES.values())):
            for m in ms:
                if probing:
                    jobs += [(bits, k, m, kw) for _, kw in _probe_variants(bits, m, n)]
                else:
                    jobs += [(bits, k, m, kw) for kw in _sweep_kwargs(m, quick) if kw["split_k"] <= 2]
    return list({repr(j): j for j in jobs}.values())


def _compile_one(job: tuple) -> str:
    bits, k, m, kw = job
    try:
        mw = random_mw(k, 256, bits, 128 if bits == 4 else -1)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        triton_mma.gemv(x, mw, **kw)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # the timed process reports it again
        return f"{job}: {exc!r}"[:200]


def precompile(quick: bool, probing: bool = False, workers: int = 15) -> None:
    """Compile every configuration the sweep (or probe) times in parallel processes (fills Triton's
    disk cache)."""
    import multiprocessing as mp

    t0 = time.time()
    jobs = _compile_jobs(quick, probing)
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_one, jobs, chunksize=1) if e]
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f} s, {len(errors)} failed", flush=True)
    for e in errors:
        print("  " + e)


def sweep(quick: bool, dump: Path | None = None) -> list[dict]:
    """Every configuration of the mma GEMV per shape and M, beside fp16 F.linear and the dispatch's choice
    (the rows so far written to `dump` after each shape, in case the run is cut short)."""
    rows = []
    for bits, ms, shape, k, n, ring, fp16 in _rings(SWEEP):
        first = ring[0]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            base = {"shape": shape, "bits": bits, "m": m}
            t16 = graph_us([lambda w=w: F.linear(x, w) for w in fp16])
            choice = dispatch.mma_choice(bits, m, n)
            told = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            best = None
            for nw, tiles, nrows, maxnreg, wr, split in CONFIGS[_cols(m)][: 2 if quick else None]:
                try:
                    us = graph_us([lambda mw=mw: triton_mma.gemv(x, mw, num_warps=nw, tiles=tiles, rows=nrows,
                                                                 maxnreg=maxnreg, warps_n=wr, split_k=split)
                                   for mw in ring])
                except Exception as exc:
                    print(f"FAILED W{bits} {shape} M={m} w{nw} t{tiles} rows{nrows} wr{wr} s{split}: {exc!r}"[:300])
                    continue
                tbps = first.nbytes / us / 1e6
                rows.append({**base, "warps": nw, "tiles": tiles, "rows": nrows, "maxnreg": maxnreg, "warps_n": wr,
                             "split_k": split, "us": us, "tbps": tbps, "fp16_us": t16, "now_us": told,
                             "now": choice.method})
                if best is None or us < best[0]:
                    best = (us, nw, tiles, tbps, maxnreg, nrows, wr, split)
            print(f"W{bits} {shape:7} M={m:2}: fp16 {t16:6.1f} | now {told:6.1f} ({choice.method}) | best "
                  f"{best[0]:6.1f} us w{best[1]} t{best[2]} rows{best[5]} r{best[4]} wr{best[6]} s{best[7]} "
                  f"{best[3]:.2f} TB/s -> x{t16 / best[0]:.2f} fp16",
                  flush=True)
        if dump is not None:
            dump.write_text(json.dumps(rows))
    return rows


# Variants timed by --probe against the dispatch's choice for the same shape and M: gemv keyword
# arguments that replace the choice's (PROBE), and whole configurations by column tiles (PROBE_EXTRA).
# Run 38: split-K across programs (one row group) and PDL on the 2-warp gate_up programs at M ≤ 16.
PROBE = [("nopdl", dict(pdl=False)), ("pdl-pf0", dict(pdl=True, prefetch=0)), ("pdl-pf2", dict(pdl=True, prefetch=2))]
_PDL = dict(pdl=True, prefetch=1)
PROBE_EXTRA = {
    cols: [dict(num_warps=nw, tiles=t, maxnreg=mx, split_k=sk, **_PDL)
           for nw, t, mx, sk in ((8, 2, 128, 2), (4, 2, 128, 2), (4, 1, 128, 2), (8, 1, 128, 2), (4, 1, 128, 4),
                                 (2, 1, None, 2), (2, 1, None, 1), (4, 1, 128, 1), (8, 1, 128, 1), (4, 2, 168, 1))]
    for cols in (1, 2)
}
PROBE_SWEEP = ((4, (1, 16)), (8, (1,)))


def probe() -> list[dict]:
    """PROBE variants of the dispatch's choice and PROBE_EXTRA configurations, per shape and M."""
    rows = []
    for bits, ms, shape, k, n, ring, fp16 in _rings(PROBE_SWEEP):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            t16 = graph_us([lambda w=w: F.linear(x, w) for w in fp16])
            line = []
            for name, kw in _probe_variants(bits, m, n):
                try:
                    us = graph_us([lambda mw=mw: triton_mma.gemv(x, mw, **kw) for mw in ring])
                except Exception as exc:
                    print(f"FAILED W{bits} {shape} M={m} {name}: {exc!r}"[:300])
                    continue
                rows.append({"shape": shape, "bits": bits, "m": m, "variant": name, "params": kw, "us": us,
                             "fp16_us": t16})
                line.append(f"{name} {us:.1f}")
            print(f"W{bits} {shape:7} M={m:2} fp16 {t16:5.1f}: " + " | ".join(line), flush=True)
    return rows


def _rings(plan, with_fp16: bool = True):
    """For each (bits, Ms) of `plan` and each shape: (bits, Ms, shape, K, N, ring of random mma
    weights, ring of fp16 weights or None without `with_fp16`), the rings several times the L2 size;
    freed after each shape."""
    for bits, ms in plan:
        gs = 128 if bits == 4 else -1
        for shape, (k, n) in SHAPES.items():
            first = random_mw(k, n, bits, gs)
            ring = [first] + [random_mw(k, n, bits, gs) for _ in range(ring_size(first.nbytes) - 1)]
            fp16 = [torch.randn(n, k, device="cuda", dtype=torch.float16)
                    for _ in range(ring_size(n * k * 2))] if with_fp16 else None
            yield bits, ms, shape, k, n, ring, fp16
            del first, ring, fp16
            torch.cuda.empty_cache()


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
    ap.add_argument("--probe", action="store_true", help="only the PROBE variants of the dispatch's choices")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.floor:
        res["floor"] = floor()
        (args.out / "floor.json").write_text(json.dumps(res, indent=1))
        return
    if args.probe:
        precompile(args.quick, probing=True)
        res["probe"] = probe()
        (args.out / "probe.json").write_text(json.dumps(res, indent=1))
        return
    if not args.skip_check:
        res["check"] = check(args.quick)
        bad = [r for r in res["check"] if not r["rel_err"] <= 1e-2]
        print(f"checks: {len(res['check'])}, failures {len(bad)}, worst "
              f"{max(r['rel_err'] for r in res['check']):.2e} ({time.time() - t0:.0f} s)", flush=True)
    if not args.skip_sweep:
        precompile(args.quick)
        res["sweep"] = sweep(args.quick, args.out / "sweep_partial.json")
    (args.out / "mma.json").write_text(json.dumps(res, indent=1))
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
