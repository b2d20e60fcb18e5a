"""Probe: the mma GEMV's word loads with other PTX cache hints (M = 1 and 16, four Llama-2-7B shapes, H200).

    PYTHONPATH=. python bench/probes/gemv_hints.py [--out DIR] [--compile-only]

Why (bench/KERNELS_NOTES.md item 79): at M = 1 the W4 GEMV reaches 66–77 % of what a read-only kernel
moves for the same bytes (bench/probes/read_floor.py), W8 79–92 %. The words are read with
`ld.global.L1::no_allocate.v4.u32`, one warp-wide load covering 512 contiguous bytes; an L2 miss then
fetches 32-byte sectors. The variants ask L2 to fetch 128 or 256 bytes per miss (`.L2::128B`,
`.L2::256B`), add the non-coherent read-only path (`.nc`), or cache at L2 only (`.cg`). Every variant
is the dispatch's configuration with only the load instruction's text changed (triton_mma's PTX
generator wrapped, its cache cleared); each is checked against the torch reference, then timed as
bench/kernel_speed.py times (CUDA-graph medians over a ring of weight buffers larger than L2).
--compile-only: compile every variant for sm_90a (ptxas) and stop — no GPU needed.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import json
from pathlib import Path

import torch

from quantkit.kernels import dispatch, triton_mma

BASE = "ld.global.L1::no_allocate.v4.u32"
VARIANTS = {"base": BASE, "L2_256B": "ld.global.L1::no_allocate.L2::256B.v4.u32",
            "L2_128B": "ld.global.L1::no_allocate.L2::128B.v4.u32",
            "nc_L2_256B": "ld.global.nc.L1::no_allocate.L2::256B.v4.u32",
            "cg_L2_256B": "ld.global.cg.L2::256B.v4.u32"}
_ORIGINAL = triton_mma._asm


def use(variant: str) -> None:
    """Make triton_mma generate its PTX with this variant's word load."""
    def patched(*args, **kwargs):
        asm, cons = _ORIGINAL(*args, **kwargs)
        assert BASE in asm
        return asm.replace(BASE, VARIANTS[variant]), cons
    triton_mma._asm = patched
    triton_mma._ASM.clear()


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_addr": "i64", "w_addr": "i64", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*fp16",
           "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32",
           "G": "i32", "RT": "i32", "SPLIT_K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    for variant, load in VARIANTS.items():
        use(variant)
        for bits in (4, 8):
            for m in (1, 16):
                for n in (4096, 12288, 22016):
                    p = dispatch.mma_choice(bits, m, n, pdl=False).params
                    cols = -(-m // 8)
                    asm, cons = triton_mma.asm_for(bits, cols, False, True, p["tiles"], p.get("rows", 1))
                    ce = dict(group_size=128, ASM=asm, CONS=cons, BITS=bits, COLS=cols, NW=p["num_warps"],
                              TILES=p["tiles"], HAS_BIAS=False, ROWS=p.get("rows", 1), WR=1, SPLIT=False, PDL=False,
                              PREFETCH=0)
                    opts = {"maxnreg": p["maxnreg"]} if p.get("maxnreg") else {}
                    out = triton.compile(ASTSource(fn=triton_mma.mma_gemv_kernel,
                                                   signature={**sig, **{k: "constexpr" for k in ce}}, constexprs=ce),
                                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=p["num_warps"], **opts))
                    assert out.asm.get("cubin") and load in out.asm["ptx"], (variant, bits, m, n)
        print(variant, "compiles", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for gemv_hints.json")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90a and stop")
    args = ap.parse_args()
    if args.compile_only:
        compile_all()
        return
    from bench.lib.kernel_timing import graph_us, rel_err
    from bench.lib.kernels_mma import _rings, reference

    rows, fails = [], 0
    for bits, ms, shape, _, n, mws, _ in _rings(((4, (1, 16)), (8, (1, 16))), with_fp16=False):
        for m in ms:
            x = torch.randn(m, mws[0].in_features, device="cuda", dtype=torch.float16)
            ref = reference(x, mws[0], None)
            p = {**dispatch.mma_choice(bits, m, n, pdl=False).params}
            row = {"shape": shape, "bits": bits, "m": m, "params": p}
            for variant in VARIANTS:
                use(variant)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                triton_mma.gemv(x, mws[0], out=out, **p)
                err = rel_err(out.float(), ref)
                fails += err > 1e-2
                row[variant] = graph_us([lambda mw=mw, x=x, p=p: triton_mma.gemv(x, mw, **p) for mw in mws])
                row[variant + "_err"] = err
            rows.append(row)
            print(f"{shape:8} W{bits} M={m:2} " + " ".join(f"{v} {row[v]:6.2f}" for v in VARIANTS)
                  + f"  worst err {max(row[v + '_err'] for v in VARIANTS):.1e}", flush=True)
    print(f"check: {fails} failures")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_hints.json").write_text(json.dumps({"rows": rows, "failures": int(fails)}, indent=1))


if __name__ == "__main__":
    main()
