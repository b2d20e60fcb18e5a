"""GPU correctness of the Triton kernels at Llama-2-7B shapes (not run by CI; needs CUDA).

Every kernel against x Wᵀ in float32, W dequantized by the torch reference (quantkit/kernels/reference.py),
on random packed weights and random activations, output poisoned with NaN before each run, in fp16 and
bf16, odd M and an N that is no multiple of any tile. Prints one line per case; exits 1 if any relative error > 1e-2.

    PYTHONPATH=. python bench/kernels_check.py [--quick]
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.lib.common import use_test_helpers
from bench.lib.kernel_timing import rel_err
from quantkit.kernels import dispatch, gluon_gemm, triton_mma
from quantkit.kernels.triton_gemm import dequantize, gemm

use_test_helpers()
from quantkit_testing.kernel_oracles import packed_layer  # noqa: E402
from quantkit.kernels.triton_gemv import gemv

TOL = 1e-2


def make_layer(k: int, n: int, bits: int, gs: int, fmt: str, symmetric: bool, seed: int):
    """(kernel-layout weights, reference linear x ↦ x Wᵀ in float32) for random q, z, s."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gsz = k if gs == -1 else gs
    q = torch.randint(0, 2**bits, (n, k), generator=g, device="cuda", dtype=torch.int32)
    if symmetric:
        z = torch.full((n, k // gsz), 2 ** (bits - 1), device="cuda", dtype=torch.int32)
    else:
        z = torch.randint(0, 2**bits, (n, k // gsz), generator=g, device="cuda", dtype=torch.int32)
    s = (torch.rand(n, k // gsz, generator=g, device="cuda") * 0.02 + 0.002).half()
    kw, w = packed_layer(q, z, s, bits, gsz, fmt, symmetric)
    return kw, lambda x: F.linear(x.float(), w)


def poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def variants(m: int):
    """(name, fn(x, kw, out)) for every kernel path worth checking at this M."""
    out = []
    if m <= 8:
        out.append(("gemv", lambda x, kw, y: gemv(x, kw, block_n=64, blocks=16, split_k=4, out=y)))
        out.append(("gemv-magic", lambda x, kw, y: gemv(x, kw, block_n=32, blocks=8, split_k=1, denormal=False, out=y)))
        out.append(("gemv-pipe", lambda x, kw, y: gemv(x, kw, block_n=16, blocks=16, split_k=4, num_warps=4, num_stages=3, out=y)))
    out.append(("gemm-swap", lambda x, kw, y: gemm(x, kw, block_m=16, block_n=64, blocks=8, split_k=3, swap_ab=True, out=y)))
    out.append(("gemm", lambda x, kw, y: gemm(x, kw, block_m=64, block_n=128, blocks=8, split_k=1, out=y)))
    out.append(("dequant", lambda x, kw, y: y.copy_(x @ dequantize(kw, x.dtype).t())))
    out.append(("dispatch", lambda x, kw, y: y.copy_(dispatch.run(x, kw, None, dispatch.choose(kw.bits, x.shape[0])))))
    return out


def mma_variants(m: int):
    """(name, fn(x, mw, out)) for the mma layout: the GEMV's configurations, its dequantize, the Gluon
    GEMM's (4-bit, fp16, Hopper) and the runtime's choice (dispatch.mma_choice)."""
    out = [("mma-dequant", lambda x, mw, y: y.copy_(x @ triton_mma.dequantize(mw, x.dtype).t())),
           ("mma-dispatch", lambda x, mw, y: y.copy_(dispatch.run(x, mw, None, dispatch.choice_for(mw, x.shape[0], x.device)))),
           ("mma-dispatch-graphed", lambda x, mw, y: y.copy_(dispatch.run(
               x, mw, None, dispatch.choice_for(mw, x.shape[0], x.device, graphed=True))))]
    if m <= 64:
        for nw, tiles, rows, reg in ((2, 1, 1, None), (4, 2, 1, None), (8, 2, 1, 128), (4, 1, 1, 128), (4, 4, 1, 168),
                                     (4, 1, 2, None), (8, 1, 4, None), (2, 2, 2, 168)):
            out.append((f"mma-w{nw}t{tiles}r{rows}", lambda x, mw, y, nw=nw, tiles=tiles, rows=rows, reg=reg:
                        triton_mma.gemv(x, mw, num_warps=nw, tiles=tiles, rows=rows, maxnreg=reg, out=y)))
        out.append(("mma-w4t1-pdl", lambda x, mw, y: triton_mma.gemv(x, mw, num_warps=4, pdl=True, prefetch=1, out=y)))
    # (BM, slots, rows, split)
    for cfg in ((32, 6, 64, 1), (64, 3, 64, 1), (64, 4, 128, 1), (32, 6, 64, 4), (128, 4, 128, 1), (64, 4, 64, 2),
                (128, 3, 64, 2), (128, 2, 64, 1), (128, 3, 64, 1), (32, 4, 64, 1), (256, 3, 64, 1)):
        out.append(("gluon-" + "-".join(map(str, cfg)), lambda x, mw, y, c=cfg: gluon_gemm.gemm(x, mw, None, y, *c)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ms", default="1,3,16,77,300")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=None, help="only the cases with these weight bits")
    args = ap.parse_args()
    cases = [  # (K, N, bits, group, format, symmetric)
        (4096, 12288, 4, 128, "awq", False), (4096, 4096, 4, 128, "awq", False),
        (4096, 22016, 4, 128, "awq", False), (11008, 4096, 4, 128, "awq", False),
        (4096, 4099, 4, 64, "packed", True), (4096, 4104, 4, 32, "awq", False),
        (4096, 12288, 8, -1, "packed", True), (11008, 4097, 8, -1, "packed", False),
    ]
    if args.quick:
        cases = cases[:2] + cases[4:7]
    if args.bits:
        cases = [c for c in cases if c[2] == args.bits]
    worst, failed = 0.0, []
    for i, (k, n, bits, gs, fmt, sym) in enumerate(cases):
        kw, ref_fn = make_layer(k, n, bits, gs, fmt, sym, seed=i)
        mw = triton_mma.from_kernel_weights(kw)
        for dtype in (torch.float16, torch.bfloat16):
            mma_ok = triton_mma.supports(bits, kw.group_size, k, kw.scales.shape[1], dtype)
            # the layout (and its dequantize) exists for these groups; the GEMV also needs the dtype
            layout_ok = triton_mma.supports(bits, kw.group_size, k, kw.scales.shape[1], torch.float16)
            for m in [int(v) for v in args.ms.split(",")]:
                x = (torch.randn(m, k, device="cuda") * 0.5).to(dtype)
                ref = ref_fn(x).float()
                runs = [(name, fn, kw) for name, fn in variants(m)]
                runs += [(name, fn, mw) for name, fn in mma_variants(m) if mma_ok or (layout_ok and name == "mma-dequant")
                         if not name.startswith("gluon") or gluon_gemm.supports(mw, dtype, x.device)]
                for name, fn, weights in runs:
                    y = poisoned(m, n, dtype)
                    try:
                        fn(x, weights, y)
                        err = rel_err(y, ref)
                    except Exception as exc:
                        print(f"ERROR {name} K={k} N={n} W{bits} g{gs} {fmt} {dtype} M={m}: {str(exc)[:300]}")
                        err = float("inf")
                    worst = max(worst, err)
                    tag = "ok" if err <= TOL else "FAIL"
                    if tag == "FAIL":
                        failed.append((name, k, n, bits, gs, fmt, str(dtype), m, err))
                    print(f"{tag:4} {name:14} K={k:5} N={n:5} W{bits} g{gs:4} {fmt:6} {str(dtype)[6:]:8} M={m:4} rel={err:.2e}", flush=True)
    print(f"worst relative error {worst:.2e}; {len(failed)} failures")
    for f in failed:
        print("FAILED", f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
