"""Probe (sixth session, not integrated): a W4 g128 GEMM for M ≥ 16 written in Gluon, Triton's explicit-layout
dialect, reading the mma layout's words in place and feeding them to wgmma from registers.

    PYTHONPATH=. python bench/gluon_probe.py [--ms 16,32,64,128,256,1024] [--out DIR]

Why Gluon: the `tl` GEMM of run 43 (bench/KERNELS_NOTES.md, item 43) could not keep the dequantized
weights in registers — Triton stored every tile to shared memory and waited for the wgmma that read
the previous one. In Gluon the layouts are ours: a program's 64 weight rows are loaded as a [64, 16]
word tile in which thread (g, t) of warp w holds rows 16·w + g and + 8 and words 4·t … 4·t + 3 (16
bytes), exactly the words the wgmma A fragment needs. The eight values of each word are dequantized
((1024 + q) − (1024 + z)) · s in fp16 and relabelled, by join / reshape / permute, to the fragment's
input order, which the compiler proves free of data movement (`convert_layout(assert_trivial=True)`).
x is permuted once per call (torch) into that same input order within each 128-input tile, so its
tiles are plain row-major [BM, 128] cp.async copies into a 3-slot shared-memory ring, two tiles ahead;
wgmma m64nBMk16 runs asynchronously with one group in flight while the next tile is dequantized; the
next tile's words are loaded into registers a step ahead. Dot order within a tile, high bit to low: c1 c0 h i t1 t0 e, where word
4·t + c of a row holds inputs 32·c + 8·t + (0…7) and input offset o = 4·h + 2·i + e.

Prints, per Llama-2-7B shape and M: fp16 F.linear, the dispatch (mma GEMV ≤ 64, dequantize + cuBLAS
above), and this kernel in each of CONFIGS (BM, ring stages, split-K), CUDA-graph medians over a ring
of weights, after a correctness check against the fp32 reference on NaN-poisoned outputs.

Outcome (runs 51–52, bench/KERNELS_NOTES.md items 51–52): correct at once (0 failures, worst 2.9e-4);
at M = 64 faster than the dispatch's GEMV on gate_up (52.5 vs 73.3 µs, 0.99× fp16) and level on qkv
(35.2 vs 36.7), slower on the narrow layers (64 programs for N = 4096) and 2–3× slower than fp16 from
M = 256 (every x tile dequantizes the weights again). Not integrated. Written against Triton 3.6's
Gluon (the lent GPU's); Gluon is experimental and moves: Triton 3.9 (the CPU machines') renamed
`async_copy.async_copy_global_to_shared` to `async_load`, so this file compiles with 3.6 only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _value(w, o: gl.constexpr, zb, s):
    """Input offset o of every word of the tile, dequantized in fp16 (nibble W4_ORDER[o] holds it)."""
    p: gl.constexpr = (o & 1) * 4 + ((o >> 1) & 1) * 2 + (o >> 2)
    q = ((w >> (4 * p)) & 15) | 0x6400
    return (q.to(gl.int16).to(gl.float16, bitcast=True) - zb) * s


@gluon.jit
def _a_operand(w, zb, s, a_l: gl.constexpr, ROWS: gl.constexpr):
    """[ROWS, 16] words → the [ROWS, 128] wgmma A operand in dot order (no data movement)."""
    e0 = gl.join(_value(w, 0, zb, s), _value(w, 1, zb, s))
    e1 = gl.join(_value(w, 2, zb, s), _value(w, 3, zb, s))
    e2 = gl.join(_value(w, 4, zb, s), _value(w, 5, zb, s))
    e3 = gl.join(_value(w, 6, zb, s), _value(w, 7, zb, s))
    v = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [64, 16, e, i, h]
    v = gl.reshape(v, [ROWS, 2, 2, 2, 2, 2, 2, 2])  # rows, t1 t0 c1 c0, e i h
    v = gl.permute(v, (0, 3, 4, 7, 6, 1, 2, 5))  # rows, c1 c0 h i t1 t0 e
    return gl.convert_layout(gl.reshape(v, [ROWS, 128]), a_l, assert_trivial=True)


@gluon.jit
def gluon_w4_gemm(w_ptr, s_ptr, z_ptr, x_ptr, out_ptr, M, N, KT, KW, G, group_size: gl.constexpr,
                  BM: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, ROWS: gl.constexpr,
                  ONE_BARRIER: gl.constexpr):
    """yᵀ [ROWS weight rows, BM x rows] per program; ROWS = 64 (4 warps, one warpgroup) or 128 (8 warps,
    two warpgroups sharing each x tile). ONE_BARRIER: refill the slot freed two steps back right after
    the step's only barrier (lookahead STAGES − 2 tiles) instead of a second barrier per step."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    per = gl.cdiv(KT, SPLIT)  # K-tiles of this program: [k0, k1)
    k0 = gl.program_id(2) * per
    k1 = gl.minimum(k0 + per, KT)
    NWARP: gl.constexpr = ROWS // 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARP, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    if ROWS == 64:
        words_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    else:
        words_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 16])
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NWARP, 1], [1, 0])
    x_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, words_l))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, words_l))
    row_ok = rows < N
    w_rows = w_ptr + (rows // 16).to(gl.int64)[:, None] * KW + (rows % 16)[:, None] * 16 + cols[None, :]
    xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, x_l))
    x_rows = x_ptr + xm.to(gl.int64)[:, None] * (KT * 128) + xk[None, :]
    x_ok = (xm < M)[:, None]
    w_s: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])
    xbuf = gl.allocate_shared_memory(gl.float16, [STAGES, BM, 128], x_s)  # ring of x tiles
    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], w_s)  # ring of word tiles
    acc = gl.zeros([ROWS, BM], gl.float32, layout=mma)
    AHEAD: gl.constexpr = STAGES - 2 if ONE_BARRIER else STAGES - 1  # tiles in flight after the prologue
    for j in gl.static_range(AHEAD):
        kt = gl.minimum(k0 + j, k1 - 1)
        async_copy.async_copy_global_to_shared(xbuf.index(j), x_rows + kt * 128, mask=x_ok)
        async_copy.async_copy_global_to_shared(wbuf.index(j), w_rows + kt * 256)
        async_copy.commit_group()
    for t in range(k0, k1):
        i = t - k0
        gi = gl.minimum(t * 128 // group_size, G - 1)
        s = gl.load(s_ptr + rows * G + gi, mask=row_ok, other=0.0)[:, None]
        zb = (gl.load(z_ptr + rows * G + gi, mask=row_ok, other=0).to(gl.int32) + 1024).to(gl.float16)[:, None]
        async_copy.wait_group(AHEAD - 1)  # this thread's copies of tile t have landed
        gl.thread_barrier()  # … and every thread's; every warp is past step i − 1's wgmma wait
        if ONE_BARRIER:  # so step i − 2's wgmma is done and its slot may be refilled
            kt = gl.minimum(t + AHEAD, k1 - 1)
            slot = (i + AHEAD) % STAGES
            async_copy.async_copy_global_to_shared(xbuf.index(slot), x_rows + kt * 128, mask=x_ok)
            async_copy.async_copy_global_to_shared(wbuf.index(slot), w_rows + kt * 256)
            async_copy.commit_group()
        w = wbuf.index(i % STAGES).load(words_l)
        a = _a_operand(w, zb, s, a_l, ROWS)
        fence_async_shared()
        acc = warpgroup_mma(a, xbuf.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # tile t − 1's wgmma is done
        if not ONE_BARRIER:
            gl.thread_barrier()  # in every warp: slot (i − 1) % STAGES may be refilled
            kt = gl.minimum(t + AHEAD, k1 - 1)
            slot = (i + AHEAD) % STAGES
            async_copy.async_copy_global_to_shared(xbuf.index(slot), x_rows + kt * 128, mask=x_ok)
            async_copy.async_copy_global_to_shared(wbuf.index(slot), w_rows + kt * 256)
            async_copy.commit_group()
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)
    orow = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    ocol = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    ptrs = out_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None]
    omask = (orow < N)[:, None] & (ocol < M)[None, :]
    if SPLIT == 1:
        gl.store(ptrs, acc.to(gl.float16), mask=omask)
    else:  # fp32 partial sums into a zeroed [M, N] buffer
        gl.atomic_add(ptrs, acc, mask=omask)


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] → [M, KT·128] fp16 with each 128-input tile in dot order (c1 c0 h i t1 t0 e), zero-padded."""
    m, k = x.shape
    kt = -(-k // 128)
    xp = torch.zeros(m, kt * 128, dtype=torch.float16, device=x.device)
    xp[:, :k] = x
    # input bits (high to low): c1 c0 t1 t0 h i e → dot order c1 c0 h i t1 t0 e
    return xp.view(m, kt, 4, 4, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(m, kt * 128).contiguous()


def gemm(x: torch.Tensor, mw, bm: int = 64, out: torch.Tensor | None = None, stages: int = 4,
         split: int = 1, rows: int = 64, one_barrier: bool = False) -> torch.Tensor:
    """y = x Wᵀ for W4 weights in the mma layout (group size a multiple of 128); `split` programs share
    each output tile's K (fp32 atomics into a zeroed buffer, then one conversion)."""
    m = x.shape[0]
    n = mw.out_features
    xp = permute_x(x)
    kt = xp.shape[1] // 128
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    dst = out if split == 1 else torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, rows), triton.cdiv(m, bm), split)
    gluon_w4_gemm[grid](mw.qweight, mw.scales, mw.zeros, xp, dst, m, n, kt, mw.qweight.shape[1], mw.scales.shape[1],
                        group_size=mw.group_size, BM=bm, STAGES=stages, SPLIT=split, ROWS=rows,
                        ONE_BARRIER=one_barrier, num_warps=rows // 16)
    if split > 1:
        out.copy_(dst)
    return out


# BM, stages, split, rows, one barrier — run 52's best first, then the variants of run 53
CONFIGS = [(64, 4, 1, 64, False), (64, 5, 1, 64, True), (64, 6, 1, 64, True), (64, 5, 1, 128, True),
           (32, 6, 1, 64, True), (32, 6, 1, 128, True), (128, 4, 1, 128, True), (256, 3, 1, 128, False),
           (64, 5, 2, 64, True)]


def main() -> None:
    from bench.kernel_timing import graph_us, rel_err
    from bench.kernels_mma import _rings, random_mw, reference
    from quantkit.kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,32,64,128,256,1024", help="rows of x")
    ap.add_argument("--out", type=Path, default=None, help="directory for gluon_probe.json")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    fails, worst = 0, 0.0
    mw = random_mw(4096, 1000, 4, 128)
    for m in (1, 77, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        ref = reference(x, mw, None)
        for bm, st, sp, rw, ob in CONFIGS:
            out = torch.full((m, 1000), float("nan"), device="cuda", dtype=torch.float16)
            try:
                err = rel_err(gemm(x, mw, bm, out, st, sp, rw, ob).float(), ref)
            except Exception as exc:  # report and go on: this is a probe
                print(f"check M={m} cfg={(bm, st, sp, rw, ob)}: {exc!r}"[:300], flush=True)
                err = float("inf")
            fails += not err <= 1e-2
            worst = max(worst, err)
    print(f"check: {3 * len(CONFIGS)} cases, {fails} failures, worst {worst:.2e}", flush=True)
    rows = []
    for bits, _, shape, k, n, ring, fp16 in _rings([(4, ms)]):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = {"shape": shape, "m": m, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            choice = dispatch.choice_for(ring[0], m, x.device)
            row["dispatch_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            for cfg in CONFIGS:
                try:
                    row[str(cfg)] = graph_us([lambda mw=mw, cfg=cfg: gemm(x, mw, cfg[0], None, *cfg[1:])
                                              for mw in ring])
                except Exception as exc:
                    row[str(cfg)] = float("nan")
                    print(f"{shape} M={m} cfg={cfg}: {exc!r}"[:200], flush=True)
            best = min(row[str(cfg)] for cfg in CONFIGS)
            rows.append(row)
            if args.out:  # after every row, in case the run is cut short
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "gluon_probe.json").write_text(json.dumps({"check_failures": fails, "worst": worst,
                                                                       "rows": rows}, indent=1))
            print(f"{shape:7} M={m:4} fp16 {row['fp16_us']:6.1f} dispatch {row['dispatch_us']:6.1f} gluon "
                  + " ".join(f"{row[str(cfg)]:6.1f}" for cfg in CONFIGS)
                  + f" -> best {row['fp16_us'] / best:.2f}x fp16 (dispatch {row['fp16_us'] / row['dispatch_us']:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
