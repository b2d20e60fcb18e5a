"""Where the eager (no CUDA graph) call of a QuantLinear spends its time, on the GPU.

    PYTHONPATH=. python bench/probes/launch_overhead.py [--calls 300] [--profile] [--gluon]

Times, per call, a loop of eager calls at M = 1 on the 4096 × 4096 (o) shape, each timed as host
wall time over the loop after a synchronize (the GPU work per call is ≈ 6 µs, so what shows is the
launch path): fp16 F.linear, an empty Triton kernel with the GEMV's argument count, triton_mma.gemv
with the dispatch's parameters, dispatch.run, and QuantLinear.forward. With --profile, cProfile of the
QuantLinear loop (top functions by own time). Before timing it checks the kept launch (GemvLaunch's
direct path) against Triton's front end: new x every call, M in {1, 3, 16, 64}, a strided output
(back to the front end), replay from a CUDA graph, QuantLinear against its dequantized weight.

--gluon [--shape qkv --m 64]: the same for the Gluon GEMM's eager call (run 61: 67.7 µs per call at
M = 64 on qkv, beside 29.9 for fp16 and 36.7 for the GEMV) — the whole call, and its parts (the permute launch, the TMA descriptor, allocations, the
GEMM launch with prebuilt arguments), beside fp16 F.linear and the mma GEMV's kept launch; after a
check that the call replayed from a CUDA graph (new x copied in) matches the eager call.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from quantkit.kernels import dispatch, triton_mma
from quantkit.nn.quant_linear import QuantLinear


@triton.jit
def _empty(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, C: tl.constexpr):
    if tl.program_id(0) == 0:
        tl.store(a5, 0.0)


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def random_layer(k: int, n: int) -> QuantLinear:
    layer = QuantLinear(k, n, 4, 128, layout="packed", device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    layer.weight_packed.random_(generator=g)
    layer.weight_zero_point.random_(generator=g)
    layer.weight_scale.uniform_(0.001, 0.01, generator=g)
    return layer


def check(layer: QuantLinear) -> int:
    """Failures of the kept launch against the front end and the reference (printed)."""
    kw = layer._kernel_weights
    w = layer.dequantized_weight().to("cuda", torch.float16)
    bad = 0
    for m in (1, 3, 16, 64):
        choice = dispatch.choice_for(kw, m, torch.device("cuda"))
        launch = triton_mma.GemvLaunch(kw, None, m, torch.device("cuda"), **choice.params)
        for i in range(4):
            x = torch.randn(m, kw.in_features, device="cuda", dtype=torch.float16)
            got = launch(x) if i < 3 else launch(x, torch.empty(m, kw.out_features + 8, device="cuda",
                                                                dtype=torch.float16)[:, :kw.out_features])
            want = triton_mma.gemv(x, kw, **choice.params)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            ref = ((layer(x).float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()).item()
            ok = err < 1e-3 and ref < 1e-2 and (launch.compiled is not None)
            bad += not ok
            print(f"check M={m:2} call {i}: kept vs front end {err:.1e}, QuantLinear vs reference {ref:.1e}"
                  f"{'' if ok else '  FAIL'}", flush=True)
        x = torch.randn(m, kw.in_features, device="cuda", dtype=torch.float16)
        out = torch.empty(m, kw.out_features, device="cuda", dtype=torch.float16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch(x, out)
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = triton_mma.gemv(x, kw, **choice.params)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        bad += not err < 1e-3
        print(f"check M={m:2} graph replay: {err:.1e}{'' if err < 1e-3 else '  FAIL'}", flush=True)
    return bad


def gluon_parts(calls: int, profile: bool, shape: str = "qkv", m: int = 64) -> int:
    """The Gluon GEMM's eager call and its parts, µs per call (printed); returns check failures."""
    from bench.lib.kernel_candidates import SHAPES
    from bench.lib.kernels_mma import random_mw
    from quantkit.kernels import gluon_gemm
    from quantkit.kernels.triton_splitk import counters, workspace

    k, n = SHAPES[shape]
    mw = random_mw(k, n, 4, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
    p = dispatch.gluon_choice(m, n, k).params
    # graph replay against the eager call: the TMA descriptors travel in the captured kernel parameters
    static_x = x.clone()
    gluon_gemm.gemm(static_x, mw, None, None, **p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gluon_gemm.gemm(static_x, mw, None, None, **p)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = gluon_gemm.gemm(static_x.clone(), mw, None, None, **p)
    err = ((static_out.float() - want.float()).norm() / want.float().norm()).item()
    print(f"check gluon graph replay vs eager: {err:.1e}{'' if err < 1e-3 else '  FAIL'}", flush=True)
    if not err < 1e-3:
        return 1
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    xp = gluon_gemm.permute_x(x)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(xp, [p["bm"], gluon_gemm.TILE_K], gluon_gemm._X_LAYOUT)
    split = p.get("split", 1)
    grid = (triton.cdiv(n, p["rows"]), triton.cdiv(m, p["bm"]), split)
    ws = workspace(split, m, n, x.device) if split > 1 else out
    counts = counters(x.device, grid[0] * grid[1]) if split > 1 else out
    gargs = (desc, gluon_gemm._w_desc(mw, p["rows"]), mw.scales, mw.zeros, out, out, ws, counts, m, n, k // 128,
             mw.scales.shape[1], 128, p["bm"], p["stages"], p["rows"], False, split, 4, *gluon_gemm._LAYOUTS[(p["rows"], 4)])
    gemv = triton_mma.GemvLaunch(mw, None, m, x.device, **dispatch.mma_choice(4, m, n).params)
    rows = {
        "fp16 F.linear": per_call_us(lambda: F.linear(x, w16), calls),
        "mma GEMV, kept launch (the sixth session's choice)": per_call_us(lambda: gemv(x, out), calls),
        "gluon_gemm.gemm (whole call)": per_call_us(lambda: gluon_gemm.gemm(x, mw, None, out, **p), calls),
        "  permute_x (kept launch + allocation)": per_call_us(lambda: gluon_gemm.permute_x(x), calls),
        "  TensorDescriptor.from_tensor": per_call_us(lambda: TensorDescriptor.from_tensor(
            xp, [p["bm"], gluon_gemm.TILE_K], gluon_gemm._X_LAYOUT), calls),
        "  torch.empty of the output": per_call_us(lambda: torch.empty(m, n, device="cuda", dtype=torch.float16),
                                                   calls),
        "  GEMM launch, kept, prebuilt arguments": per_call_us(lambda: gluon_gemm._GEMM(
            grid, gargs, num_warps=p["rows"] // 16), calls),
    }
    print(f"gluon choice {p}")
    for name, us in rows.items():
        print(f"{name:52} {us:7.1f} µs/call")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            gluon_gemm.gemm(x, mw, None, out, **p)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--profile", action="store_true", help="cProfile the QuantLinear loop")
    ap.add_argument("--gluon", action="store_true", help="the Gluon GEMM's eager call instead (--shape, --m)")
    ap.add_argument("--shape", default="qkv", help="with --gluon: the Llama-2-7B linear (qkv, o, gate_up, down)")
    ap.add_argument("--m", type=int, default=64, help="with --gluon: rows of x (17 … 512)")
    args = ap.parse_args()
    if args.gluon:
        raise SystemExit(gluon_parts(args.calls, args.profile, args.shape, args.m))
    k = n = 4096
    layer = random_layer(k, n)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
    layer(x)
    kw = layer._kernel_weights
    failures = check(layer)
    print(f"check: {failures} failures", flush=True)
    if failures:
        raise SystemExit(1)
    launch = triton_mma.GemvLaunch(kw, None, 1, x.device, **dispatch.choice_for(kw, 1, x.device).params)
    choice = dispatch.choice_for(kw, 1, x.device)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16)
    a = [x, kw.qweight, kw.scales, kw.zeros, out, out] + [1] * 11
    rows = {
        "fp16 F.linear": per_call_us(lambda: F.linear(x, w16), args.calls),
        "empty Triton kernel, 17 args": per_call_us(lambda: _empty[(256,)](*a, C=3), args.calls),
        "triton_mma.gemv": per_call_us(lambda: triton_mma.gemv(x, kw, None, out=out, **choice.params), args.calls),
        "kept GemvLaunch": per_call_us(lambda: launch(x, out), args.calls),
        "dispatch.run": per_call_us(lambda: dispatch.run(x, kw, None, choice), args.calls),
        "QuantLinear.forward": per_call_us(lambda: layer(x), args.calls),
    }
    print(f"choice {choice}")
    for name, us in rows.items():
        print(f"{name:32} {us:7.1f} µs/call")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            layer(x)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
