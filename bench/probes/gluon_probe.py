"""Configurations of the Gluon W4 / W8 GEMM (quantkit/kernels/gluon_gemm.py) against the dispatch and fp16.

    PYTHONPATH=. python bench/probes/gluon_probe.py [--ms 16,32,48,64,96,128,192,256] [--bits 4|8] [--out DIR]

First a correctness check of every configuration (K × N = 4096 × 1000, 4096 × 4096, 11008 × 4096,
200 × 136 with one group per row, 1024 × 520 with g256; M = 1, 16, 17, 77, 300; bias and split-K
variants) against the fp32 reference on NaN-poisoned outputs, printed per configuration; then, per
Llama-2-7B shape and M: fp16 F.linear, the dispatch's choice, torch's and the Triton permutation of x
alone, and each configuration of SMALL (M ≤ 64) or LARGE (M ≥ 96) (BM, ring slots, weight rows per
program, split-K), CUDA-graph medians over a ring of weights. The Gluon rows of
quantkit/kernels/dispatch_table.py were set from this script's output (runs 57–58, 61–62; bench/KERNELS_NOTES.md items 54–63). `--launch LABEL` only launches one configuration, for Nsight
Compute (bench/probes/gluon_profile.sh).

The shared-memory-A form (dequantized weights stored to a shared-memory A tile, x unpermuted; run 61,
item 62: slower than this kernel everywhere) is in git history at commit e98489f (bench/gluon_smem_a.py).
The sixth session's probe kernels that the package kernel grew from (a cp.async form with optional
one-barrier ring and asm dequantization, and the first TMA form, both with x permuted by torch and
one K-step per loop iteration, hence the A-register race of item 58 at BM ≥ 64) are in git history
at commit 979f320 (this file), with their runs 51–56 in bench/KERNELS_NOTES.md.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# quantkit.kernels.gluon_gemm: (BM, stages, weight rows per program, split-K), timed at M ≤ 64 (SMALL)
# or M ≥ 96 (LARGE). Split-K adds the partial sums in the same launch (the last program of each output
# tile, item 63); runs 57–59 timed the earlier split-K through atomics and two more launches.
SMALL = [(16, 8, 64, 1), (16, 8, 64, 2), (16, 8, 64, 4), (16, 8, 64, 8), (32, 6, 64, 1), (32, 6, 64, 2),
         (32, 6, 64, 4), (64, 4, 64, 1), (64, 3, 64, 1), (64, 4, 64, 2), (64, 4, 64, 4), (64, 4, 128, 2),
         # smaller rings (run 71: level with the dispatch for W4; (32, 4, 64) wins gate_up for W8, run 70)
         (64, 2, 64, 1), (32, 3, 64, 1), (32, 4, 64, 1), (64, 3, 128, 1)]
LARGE = [(64, 3, 64, 1), (128, 3, 64, 1), (128, 2, 64, 1), (128, 4, 128, 1), (128, 2, 128, 1), (128, 3, 64, 2),
         (128, 2, 64, 2), (256, 3, 64, 1)]  # BM 256: run 72
# Run 75 also timed HALF (K-tiles as two 64-input wgmma groups, a fifth element, since removed): level or
# slower everywhere (bench/KERNELS_NOTES.md item 77).


ONLY: list[tuple[int, ...]] = []  # --only: these configurations instead of SMALL and LARGE


def _variants(m: int | None = None):
    """(label, fn(x, mw, out)) for every configuration timed at M rows of x (all of them for None)."""
    from quantkit.kernels import gluon_gemm

    if ONLY:
        configs = ONLY
    else:
        configs = SMALL + [c for c in LARGE if c not in SMALL] if m is None else SMALL if m <= 64 else LARGE
    return [(f"gg{cfg}", lambda x, mw, o, cfg=cfg: gluon_gemm.gemm(x, mw, None, o, *cfg)) for cfg in configs]


def main() -> None:
    from bench.lib.kernel_timing import graph_us, rel_err
    from bench.lib.kernels_mma import _rings, random_mw, reference
    from quantkit.kernels import dispatch, gluon_gemm
    from bench.lib.common import use_test_helpers
    use_test_helpers()
    from quantkit_testing.kernel_oracles import permute_x_torch  # torch's permute-and-copy, timed beside permute_x

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,32,64,128,256,1024", help="rows of x")
    ap.add_argument("--out", type=Path, default=None, help="directory for gluon_probe.json")
    ap.add_argument("--launch", default=None, metavar="LABEL",
                    help="only launch the variant LABEL (as printed, e.g. 'gg(64, 4, 64, 1)') five times on "
                         "--shape at the first of --ms, for Nsight Compute (bench/probes/gluon_profile.sh)")
    ap.add_argument("--shape", default="qkv", help="with --launch: the Llama-2-7B linear")
    ap.add_argument("--check-only", action="store_true", help="only the correctness check")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check (timings only)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8),
                    help="weight bits (8: per-channel scales in the timings, as bench/kernel_speed.py; "
                         "the W8 Gluon rows of kernels/dispatch_table.py were set from this, run 68)")
    ap.add_argument("--only", default=None, metavar="BM,SLOTS,ROWS,SPLIT;...",
                    help="check and time only these configurations (instead of SMALL / LARGE)")
    args = ap.parse_args()
    if args.only:
        ONLY.extend(tuple(int(v) for v in c.split(",")) for c in args.only.split(";"))
    bits = args.bits
    timing_gs = 128 if bits == 4 else -1
    ms = [int(v) for v in args.ms.split(",")]
    if args.launch:
        from bench.lib.kernel_candidates import SHAPES

        k, n = SHAPES[args.shape]
        fn = dict(_variants())[args.launch]
        mw = random_mw(k, n, bits, timing_gs)
        x = torch.randn(ms[0], k, device="cuda", dtype=torch.float16)
        for _ in range(5):
            fn(x, mw, None)
        torch.cuda.synchronize()
        return
    fails, worst, per = 0, 0.0, {}
    checks = () if args.no_check else ((4096, 1000, 128), (4096, 4096, 128), (11008, 4096, 128), (200, 136, -1),
                                        (1024, 520, 256))
    for k, n, gs in checks:
        mw = random_mw(k, n, bits, gs)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        for m in (1, 16, 17, 77, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference(x, mw, None)
            variants = _variants() + [("gg(32, 6, 64)+bias", lambda x, mw, o: gluon_gemm.gemm(x, mw, bias, o, 32, 6, 64)
                                       - bias), ("gg(32, 6, 64, 4)+bias", lambda x, mw, o:
                                                 gluon_gemm.gemm(x, mw, bias, o, 32, 6, 64, 4) - bias),
                                      ("gg(16, 8, 64, 8)+bias", lambda x, mw, o:
                                       gluon_gemm.gemm(x, mw, bias, o, 16, 8, 64, 8) - bias)]
            for label, fn in variants:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                try:
                    err = rel_err(fn(x, mw, out).float(), ref)
                except Exception as exc:  # report and go on: this is a probe
                    print(f"check M={m} {label}: {exc!r}"[:300], flush=True)
                    err = float("inf")
                fails += not err <= 1e-2
                worst = max(worst, err)
                per.setdefault(label, []).append(f"{k}x{n} M={m}: {err:.1e}")
    for label, errs in per.items():
        print(f"check {label}: " + ", ".join(errs), flush=True)
    # split K: the same bits on every call, whichever program of a tile arrives last
    mw = random_mw(11008, 4096, bits, 128)
    x = torch.randn(64, 11008, device="cuda", dtype=torch.float16)
    for cfg in [c for c in (ONLY or SMALL + LARGE) if c[3] > 1 and not args.no_check]:
        first = gluon_gemm.gemm(x, mw, None, None, *cfg)
        same = all(torch.equal(first, gluon_gemm.gemm(x, mw, None, None, *cfg)) for _ in range(30))
        fails += not same
        print(f"check gg{cfg} reproducible over 31 calls: {same}", flush=True)
    print(f"check: {sum(map(len, per.values()))} cases, {fails} failures, worst {worst:.2e}", flush=True)
    if args.check_only:
        raise SystemExit(1 if fails else 0)
    rows = []
    for _, _, shape, k, n, ring, fp16 in _rings([(bits, ms)]):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = {"shape": shape, "m": m, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            choice = dispatch.choice_for(ring[0], m, x.device, graphed=True)
            row["dispatch_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            row["permute_us"] = graph_us([lambda: permute_x_torch(x)])
            xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(4)]
            row["permute_triton_us"] = graph_us([lambda xi=xi: gluon_gemm.permute_x(xi) for xi in xs])
            for label, fn in _variants(m):
                try:
                    row[label] = graph_us([lambda mw=mw, fn=fn: fn(x, mw, None) for mw in ring])
                except Exception as exc:
                    row[label] = float("nan")
                    print(f"{shape} M={m} {label}: {exc!r}"[:200], flush=True)
            labels = [label for label, _ in _variants(m)]
            best = min((row[label], label) for label in labels if row[label] == row[label])
            rows.append(row)
            if args.out:  # after every row, in case the run is cut short
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"gluon_probe_w{bits}.json").write_text(json.dumps(
                    {"bits": bits, "check_failures": fails, "worst": worst, "rows": rows}, indent=1))
            print(f"{shape:7} M={m:4} fp16 {row['fp16_us']:6.1f} dispatch {row['dispatch_us']:6.1f} ("
                  + f"{choice.method} {choice.params}) " + " ".join(f"{label} {row[label]:.1f}" for label in labels)
                  + f" -> best {best[1]} {row['fp16_us'] / best[0]:.2f}x fp16 "
                  f"(dispatch {row['fp16_us'] / row['dispatch_us']:.2f}x; permute_x {row['permute_us']:.1f}, "
                  f"Triton {row['permute_triton_us']:.1f})", flush=True)


if __name__ == "__main__":
    main()
