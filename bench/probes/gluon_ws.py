"""Probe: the Gluon GEMM with a producer warp — correct, and slower than the package kernel (run 75).

    PYTHONPATH=. python bench/probes/gluon_ws.py [--ms 64,128,256,512,1024] [--bits 4|8] [--out DIR]

Why (bench/KERNELS_NOTES.md items 70 and 75): at M ≥ 256 quantkit/kernels/gluon_gemm.py is
latency-bound with 8 warps per SM, and each of its K-steps syncs the program's 4 warps four times
(SASS of BM 128: the CTA barrier after the wgmma wait, and the barriers Triton puts around the
single-thread mbarrier.expect and the two TMA issues, plus a MEMBAR.ALL.CTA). Here one worker warp
(`gl.warp_specialize`) issues the copies, the default partition's warpgroup only waits for a slot's
`ready` barrier and, once that step's wgmma has retired, arrives on its `empty` barrier — no CTA
barrier in the K loop. A single arrival per step suffices: a wgmma is collective, so when step i − 1's
has retired every warp of the group has issued it, i.e. has read its words of step i − 1.

Variants (`CONFIGS`): one or two consumer warpgroups per program (two share each x tile, 128 weight
rows; the second is a worker partition with its own epilogue, and `empty` counts both arrivals),
and the launch's register budget `maxnreg`, which sets how many programs share an SM (warps count by
groups of four; the consumers get the rest through `setmaxnreg`: 232 registers at maxnreg 128). Same
operands, dequantization and dot order as the package kernel (its helpers are imported); no split K;
bias optional. First a check against the fp32 reference on NaN-poisoned outputs (the shapes of
gluon_probe.py, M = 1, 16, 17, 77, 300), then CUDA-graph medians against the package kernel's
dispatch choice and fp16 `F.linear`.

Outcome (run 75, W4, bench/results/gluon_ws_w4_run75.{txt,json}; bench/KERNELS_NOTES.md item 76): 160
checks, 0 failures; at M = 256–1024 the best variant 2–10 % slower than the package kernel's dispatch
choice; at M = 64–128 mixed (qkv M = 64 and o M = 128 5–6 % faster, down 25–80 % slower without split
K). Run 75 also timed HALF forms (K-tiles as two 64-input wgmma groups), since removed here and from
the package.
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
import triton

from quantkit.kernels import gluon_gemm as gg

if gg.gluon is not None:
    from quantkit.kernels.gluon_gemm import (TK, _a_tile, _barrier, _ring, _scales, _tma_load, _w_load, gl,
                                             gluon)
    from quantkit.kernels.gluon_gemm import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _ws_load(x_desc, w_desc, xbuf, wbuf, ready, empty, pid_m, pid_n, KT, BM: gl.constexpr, STAGES: gl.constexpr,
                 ROWS: gl.constexpr, BYTES: gl.constexpr, BITS: gl.constexpr):
        """The producer warp: for each K-tile, wait until its slot is empty, then copy x and the words."""
        for i in range(KT):
            slot = i % STAGES
            # an mbarrier starts with its phase "1" complete, so the first round through the ring passes
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            fence_async_shared()  # the consumers' generic reads of the slot before the copy engine's writes
            mbarrier.expect(ready.index(slot), BYTES)
            _tma_load(x_desc, [pid_m * BM, i * TK], ready.index(slot), xbuf.index(slot))
            _w_load(w_desc, pid_n, i, ready.index(slot), wbuf.index(slot), True, ROWS, BITS)

    @gluon.jit
    def _ws_step(i, c: gl.constexpr, acc, s, z, xbuf, wbuf, ready, empty, s_ptr, z_ptr, rows, row_ok, G,
                 group_size: gl.constexpr, STAGES: gl.constexpr, BITS: gl.constexpr, load_l: gl.constexpr,
                 words_l: gl.constexpr, a_l: gl.constexpr):
        """K-step i of consumer c (weight rows 64·c … 64·c + 63 of the program): wait for the slot,
        dequantize, start the wgmma, retire step i − 1's and release that step's
        slot (one arrival per consumer)."""
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        mine = wbuf.index(slot).slice(4 * c, 4, dim=0)  # this consumer's 4 row tiles
        a = _a_tile(mine, z, s, 64, BITS, load_l, words_l, a_l)
        s, z = _scales(i + 1, s_ptr, z_ptr, rows, row_ok, G, group_size)
        acc = warpgroup_mma(a, xbuf.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        return acc, s, z

    @gluon.jit
    def _ws_consumer(c: gl.constexpr, xbuf, wbuf, ready, empty, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, pid_m,
                     pid_n, group_size: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, NCONS: gl.constexpr,
                     BITS: gl.constexpr, HAS_BIAS: gl.constexpr, load_l: gl.constexpr, words_l: gl.constexpr):
        """Consumer warpgroup c: the K loop of gluon_gemm's kernel for its 64 weight rows without the
        copies (two steps per iteration, item 58), then its part of the output."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        base = pid_n * (64 * NCONS) + 64 * c
        rows = base + gl.arange(0, 64, layout=gl.SliceLayout(1, words_l))
        row_ok = rows < N
        acc = gl.zeros([64, BM], gl.float32, layout=mma)
        s, z = _scales(0, s_ptr, z_ptr, rows, row_ok, G, group_size)
        for i in range(0, KT - 1, 2):
            acc, s, z = _ws_step(i, c, acc, s, z, xbuf, wbuf, ready, empty, s_ptr, z_ptr, rows, row_ok, G,
                                 group_size, STAGES, BITS, load_l, words_l, a_l)
            acc, s, z = _ws_step(i + 1, c, acc, s, z, xbuf, wbuf, ready, empty, s_ptr, z_ptr, rows, row_ok, G,
                                 group_size, STAGES, BITS, load_l, words_l, a_l)
        if KT % 2 == 1:
            acc, s, z = _ws_step(KT - 1, c, acc, s, z, xbuf, wbuf, ready, empty, s_ptr, z_ptr, rows, row_ok, G,
                                 group_size, STAGES, BITS, load_l, words_l, a_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        orow = base + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        ocol = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            acc = acc + gl.load(b_ptr + orow, mask=orow < N, other=0.0).to(gl.float32)[:, None]
        omask = (orow < N)[:, None] & (ocol < M)[None, :]
        gl.store(out_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None], acc.to(gl.float16), mask=omask)

    @gluon.jit
    def ws_gemm_kernel(x_desc, w_desc, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, group_size: gl.constexpr,
                       BM: gl.constexpr, STAGES: gl.constexpr, NCONS: gl.constexpr, HAS_BIAS: gl.constexpr,
                       BITS: gl.constexpr, CREG: gl.constexpr, load_l: gl.constexpr,
                       words_l: gl.constexpr):
        """out[m, n] = Σ_k x[m, k] · W[n, k] (+ b[n]) for BM rows of x and 64 · NCONS weight rows: NCONS (1
        or 2) consumer warpgroups (the default partition and, for 2, a worker of CREG registers) share each
        x tile, a worker warp issues the copies. load_l / words_l: gluon_gemm's layouts for 64 rows."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        ROWS: gl.constexpr = 64 * NCONS
        xbuf, wbuf = _ring(x_desc, w_desc, BM, STAGES, ROWS, BITS)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=NCONS)
        fence_async_shared()
        _barrier()
        BYTES: gl.constexpr = BM * TK * 2 + ROWS * TK * BITS // 8
        if NCONS == 1:
            gl.warp_specialize([
                (_ws_consumer, (0, xbuf, wbuf, ready, empty, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, pid_m, pid_n,
                                group_size, BM, STAGES, NCONS, BITS, HAS_BIAS, load_l, words_l)),
                (_ws_load, (x_desc, w_desc, xbuf, wbuf, ready, empty, pid_m, pid_n, KT, BM, STAGES, ROWS, BYTES, BITS)),
            ], [1], [24])
        else:
            gl.warp_specialize([
                (_ws_consumer, (0, xbuf, wbuf, ready, empty, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, pid_m, pid_n,
                                group_size, BM, STAGES, NCONS, BITS, HAS_BIAS, load_l, words_l)),
                (_ws_consumer, (1, xbuf, wbuf, ready, empty, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, pid_m, pid_n,
                                group_size, BM, STAGES, NCONS, BITS, HAS_BIAS, load_l, words_l)),
                (_ws_load, (x_desc, w_desc, xbuf, wbuf, ready, empty, pid_m, pid_n, KT, BM, STAGES, ROWS, BYTES, BITS)),
            ], [4, 1], [CREG, 24])


def gemm_ws(x: torch.Tensor, mw, bias: torch.Tensor | None = None, out: torch.Tensor | None = None, bm: int = 128,
            stages: int = 3, ncons: int = 1, maxnreg: int = 128, creg: int = 160) -> torch.Tensor:
    """y = x Wᵀ (+ bias) through `ws_gemm_kernel` (weights and x as gluon_gemm.gemm takes them): ncons (1
    or 2) consumer warpgroups of 64 weight rows each; maxnreg: the registers per thread the launch budgets
    for every warp (4 per consumer, 4 for the producer's group; 128 with one consumer lets two programs
    share an SM); creg: the worker consumers' registers."""
    m, n = x.shape[0], mw.out_features
    xp = gg.permute_x(x)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    kt = xp.shape[1] // gg.TILE_K
    x_desc = gg.TensorDescriptor.from_tensor(xp, [bm, gg.TILE_K], gg._X_LAYOUT)
    grid = (triton.cdiv(n, 64 * ncons), triton.cdiv(m, bm))
    ws_gemm_kernel[grid](x_desc, gg._w_desc(mw, 64 * ncons), mw.scales, mw.zeros, bias if bias is not None else out,
                         out, m, n, kt, mw.scales.shape[1], mw.group_size, bm, stages, ncons, bias is not None, mw.bits,
                         creg, *gg._LAYOUTS[(64, mw.bits)], num_warps=4, maxnreg=maxnreg)
    return out


# BM, slots, consumers, maxnreg, the second consumer's registers. Warps count by groups of 4 for
# registers (the producer's one warp takes a group): one consumer at maxnreg 128 lets two programs share
# an SM; two consumers share x, one program.
CONFIGS = [(128, 3, 1, 128, 160), (128, 2, 1, 128, 160), (64, 4, 1, 128, 160), (256, 3, 1, 255, 160),
           (128, 3, 2, 168, 168), (128, 4, 2, 168, 168)]


def main() -> None:
    from bench.lib.kernel_timing import graph_us, rel_err
    from bench.lib.kernels_mma import _rings, random_mw, reference
    from quantkit.kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="64,128,256,512,1024", help="rows of x to time")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--out", type=Path, default=None, help="directory for gluon_ws.json")
    args = ap.parse_args()
    fails, worst = 0, 0.0
    for k, n, gs in ((4096, 1000, 128), (11008, 4096, 128), (200, 136, -1), (1024, 520, 256)):
        mw = random_mw(k, n, args.bits, gs)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        for m in (1, 16, 17, 77, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference(x, mw, bias)
            for cfg in CONFIGS:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                try:
                    err = rel_err(gemm_ws(x, mw, bias, out, *cfg).float(), ref)
                except Exception as exc:  # report and go on: this is a probe
                    print(f"check {k}x{n} M={m} ws{cfg}: {exc!r}"[:400], flush=True)
                    err = float("inf")
                fails += not err <= 1e-2
                worst = max(worst, err)
                print(f"check {k}x{n} g{gs} M={m} ws{cfg}: {err:.2e}", flush=True)
    print(f"check: {fails} failures, worst {worst:.2e}", flush=True)
    rows = []
    ms = [int(v) for v in args.ms.split(",")]
    for _, _, shape, k, n, ring, fp16 in _rings([(args.bits, ms)]):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = {"shape": shape, "m": m, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            choice = dispatch.choice_for(ring[0], m, x.device, graphed=True)
            row["dispatch"] = f"{choice.method} {choice.params}"
            row["dispatch_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            for cfg in CONFIGS:
                try:
                    row[f"ws{cfg}"] = graph_us([lambda mw=mw, cfg=cfg: gemm_ws(x, mw, None, None, *cfg) for mw in ring])
                except Exception as exc:
                    row[f"ws{cfg}"] = float("nan")
                    print(f"{shape} M={m} ws{cfg}: {exc!r}"[:300], flush=True)
            rows.append(row)
            print(" ".join(f"{key} {v:.1f}" if isinstance(v, float) else f"{key} {v}" for key, v in row.items()),
                  flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "gluon_ws.json").write_text(json.dumps({"bits": args.bits, "check_failures": fails,
                                                                    "worst": worst, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
