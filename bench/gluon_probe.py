"""Configurations of the Gluon W4 GEMM (quantkit/kernels/gluon_gemm.py) against the dispatch and fp16,
and (with --all) the sixth session's probe kernels that it grew from.

    PYTHONPATH=. python bench/gluon_probe.py [--ms 16,32,48,64,96,128,192,256] [--out DIR] [--all]

First a correctness check of every configuration (K × N = 4096 × 1000, 4096 × 4096, 11008 × 4096,
200 × 136 with one group per row, 1024 × 520 with g256; M = 1, 16, 17, 77, 300; bias and split-K
variants) against the fp32 reference on NaN-poisoned outputs, printed per configuration; then, per
Llama-2-7B shape and M: fp16 F.linear, the dispatch's choice, torch's and the Triton permutation of x
alone, and each of GG_CONFIGS (BM, ring slots, weight rows per program, split-K), CUDA-graph medians
over a ring of weights. `dispatch.gluon_choice` was set from this script's output (runs 57–58,
bench/KERNELS_NOTES.md items 54–59).

The probe kernels (--all; x permuted by torch first): `gluon_w4_gemm`, a cp.async form (optionally
one barrier per step — wrong, run 54 — and the asm dequantization DEQ_ASM), and `gluon_w4_gemm_tma`,
the TMA form the package kernel was made from. Both keep one K-step per loop iteration and so share
the A-register race of item 58 at BM ≥ 64 (the package kernel runs two steps per iteration). Their
layout notes: a program's weight rows are loaded as a word tile in which thread (g, t) of warp w
holds rows 16·w + g and + 8 and words 4·t … 4·t + 3 — the wgmma A fragment's words; each word's 8
values are dequantized in fp16 and relabelled by join / reshape / permute to the fragment's input
order c1 c0 h i t1 t0 e (word 4·t + c holds inputs 32·c + 8·t + o, o = 4·h + 2·i + e), which the
compiler proves free of data movement (`convert_layout(assert_trivial=True)`). Written against
Triton 3.6's Gluon (the lent GPU's); the package module papers over 3.9's renamed calls, this probe
does not.
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
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# the asm dequantization (DEQ_ASM), its pair arguments and the word tile's layout: the package's
from quantkit.kernels.gluon_gemm import _ASM, _CONS, _pair_bits, words_layout


@gluon.jit
def _value(w, o: gl.constexpr, zb, s):
    """Input offset o of every word of the tile, dequantized in fp16 (nibble W4_ORDER[o] holds it)."""
    p: gl.constexpr = (o & 1) * 4 + ((o >> 1) & 1) * 2 + (o >> 2)
    q = ((w >> (4 * p)) & 15) | 0x6400
    return (q.to(gl.int16).to(gl.float16, bitcast=True) - zb) * s


@gluon.jit
def _a_operand(w, zb, s, a_l: gl.constexpr, ROWS: gl.constexpr, DEQ: gl.constexpr = False, z=None):
    """[ROWS, 16] words → the [ROWS, 128] wgmma A operand in dot order (no data movement). DEQ: the
    values come from DEQ_ASM (z: the zero points, int32 [ROWS, 1]); else from plain Gluon arithmetic."""
    if DEQ:
        q = gl.inline_asm_elementwise(
            _ASM, _CONS,
            [w, _pair_bits(-(z + 1024).to(gl.float32)), _pair_bits(-(z + 64).to(gl.float32)), _pair_bits(s)],
            dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        e0 = gl.join(q[0], q[1])
        e1 = gl.join(q[2], q[3])
        e2 = gl.join(q[4], q[5])
        e3 = gl.join(q[6], q[7])
    else:
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
                  ONE_BARRIER: gl.constexpr, DEQ: gl.constexpr, words_l: gl.constexpr):
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
        z = gl.load(z_ptr + rows * G + gi, mask=row_ok, other=0).to(gl.int32)[:, None]
        zb = (z + 1024).to(gl.float16)
        async_copy.wait_group(AHEAD - 1)  # this thread's copies of tile t have landed
        gl.thread_barrier()  # … and every thread's; every warp is past step i − 1's wgmma wait
        if ONE_BARRIER:  # so step i − 2's wgmma is done and its slot may be refilled
            kt = gl.minimum(t + AHEAD, k1 - 1)
            slot = (i + AHEAD) % STAGES
            async_copy.async_copy_global_to_shared(xbuf.index(slot), x_rows + kt * 128, mask=x_ok)
            async_copy.async_copy_global_to_shared(wbuf.index(slot), w_rows + kt * 256)
            async_copy.commit_group()
        w = wbuf.index(i % STAGES).load(words_l)
        a = _a_operand(w, zb, s, a_l, ROWS, DEQ, z)
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


@gluon.jit
def gluon_w4_gemm_tma(x_desc, w_desc, s_ptr, z_ptr, out_ptr, M, N, KT, G, group_size: gl.constexpr,
                      BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, DEQ: gl.constexpr,
                      words_l: gl.constexpr):
    """The same product with TMA copies into the ring, completion on one mbarrier per slot. A TMA write is
    visible to wgmma (async proxy) and to ordinary loads once its mbarrier phase completes, so the
    wgmma needs no proxy fence after the copies (the cp.async form fences before every wgmma, a MEMBAR
    that may wait for its copies still in flight), and no thread computes copy addresses. The explicit
    barrier: every warp is past its wgmma wait before the slot of step t − 1 is refilled. (Compiled
    here: Triton adds a proxy fence before the TMA that rewrites a slot whose words were read by
    ordinary loads, and three more barriers per step; 95 registers at BM = 64.)"""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    NWARP: gl.constexpr = ROWS // 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARP, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])
    rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, words_l))
    row_ok = rows < N
    xbuf = gl.allocate_shared_memory(gl.float16, [STAGES, BM, 128], x_desc.layout)
    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS // 16, 256], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    fence_async_shared()  # (run 54: without these two, warps could wait on a slot's stale barrier left
    gl.thread_barrier()  # in shared memory by an earlier program: wrong results once programs queued)
    BYTES: gl.constexpr = BM * 128 * 2 + ROWS * 16 * 4
    for j in gl.static_range(STAGES - 1):  # tiles 0 … STAGES − 2
        mbarrier.expect(ready.index(j), BYTES, pred=j < KT)
        tma.async_copy_global_to_shared(x_desc, [pid_m * BM, j * 128], ready.index(j), xbuf.index(j), pred=j < KT)
        tma.async_copy_global_to_shared(w_desc, [pid_n * (ROWS // 16), j * 256], ready.index(j), wbuf.index(j),
                                        pred=j < KT)
    acc = gl.zeros([ROWS, BM], gl.float32, layout=mma)
    for t in range(KT):
        slot = t % STAGES
        gi = gl.minimum(t * 128 // group_size, G - 1)
        s = gl.load(s_ptr + rows * G + gi, mask=row_ok, other=0.0)[:, None]
        z = gl.load(z_ptr + rows * G + gi, mask=row_ok, other=0).to(gl.int32)[:, None]
        zb = (z + 1024).to(gl.float16)
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        w = wbuf.index(slot)._reinterpret(gl.int32, [ROWS, 16], plain).load(words_l)
        a = _a_operand(w, zb, s, a_l, ROWS, DEQ, z)
        acc = warpgroup_mma(a, xbuf.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # step t − 1's wgmma is done
        gl.thread_barrier()  # … in every warp, and every warp has read its words of slot t − 1
        nt = t + STAGES - 1  # into the slot of step t − 1
        ns = nt % STAGES
        mbarrier.expect(ready.index(ns), BYTES, pred=nt < KT)
        tma.async_copy_global_to_shared(x_desc, [pid_m * BM, nt * 128], ready.index(ns), xbuf.index(ns), pred=nt < KT)
        tma.async_copy_global_to_shared(w_desc, [pid_n * (ROWS // 16), nt * 256], ready.index(ns), wbuf.index(ns),
                                        pred=nt < KT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))
    orow = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    ocol = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    ptrs = out_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None]
    gl.store(ptrs, acc.to(gl.float16), mask=(orow < N)[:, None] & (ocol < M)[None, :])


def tma_layouts():
    """(x tile, word tile) shared layouts of the TMA kernel: x 128-byte swizzled for wgmma, the words
    unswizzled (a [row tiles, 256] box is then the [rows, 16] word tile, row-major)."""
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return x_layout, w_layout


def gemm_tma(x: torch.Tensor, mw, bm: int = 64, stages: int = 4, rows: int = 64, deq: bool = True,
             out: torch.Tensor | None = None, permute=None) -> torch.Tensor:
    """`gemm` through gluon_w4_gemm_tma (host-side TMA descriptors over permuted x and the words);
    permute: the function that permutes x (default: torch, `permute_x`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, n = x.shape[0], mw.out_features
    xp = (permute or permute_x)(x)
    kt = xp.shape[1] // 128
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    x_layout, w_layout = tma_layouts()
    x_desc = TensorDescriptor.from_tensor(xp, [bm, 128], x_layout)
    w_desc = TensorDescriptor.from_tensor(mw.qweight, [rows // 16, 256], w_layout)
    grid = (triton.cdiv(n, rows), triton.cdiv(m, bm))
    gluon_w4_gemm_tma[grid](x_desc, w_desc, mw.scales, mw.zeros, out, m, n, kt, mw.scales.shape[1],
                            group_size=mw.group_size, BM=bm, STAGES=stages, ROWS=rows, DEQ=deq,
                            words_l=words_layout(rows), num_warps=rows // 16)
    return out


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] → [M, KT·128] fp16 with each 128-input tile in dot order (c1 c0 h i t1 t0 e), zero-padded."""
    m, k = x.shape
    kt = -(-k // 128)
    if k == kt * 128 and x.dtype == torch.float16:  # one copy kernel, no padding
        xp = x
    else:
        xp = torch.zeros(m, kt * 128, dtype=torch.float16, device=x.device)
        xp[:, :k] = x
    # input bits (high to low): c1 c0 t1 t0 h i e → dot order c1 c0 h i t1 t0 e
    return xp.reshape(m, kt, 4, 4, 2, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(m, kt * 128).contiguous()


def gemm(x: torch.Tensor, mw, bm: int = 64, out: torch.Tensor | None = None, stages: int = 4,
         split: int = 1, rows: int = 64, one_barrier: bool = False, deq: bool = False) -> torch.Tensor:
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
                        ONE_BARRIER=one_barrier, DEQ=deq, words_l=words_layout(rows), num_warps=rows // 16)
    if split > 1:
        out.copy_(dst)
    return out


# TMA form (gluon_w4_gemm_tma): BM, stages, rows, asm dequantization
TMA_CONFIGS = [(64, 4, 64, True), (64, 5, 64, True), (64, 4, 128, True), (32, 6, 64, True), (128, 4, 128, True),
               (256, 3, 128, True), (64, 4, 64, False), (16, 8, 64, True), (32, 8, 64, True), (16, 6, 128, True),
               (32, 4, 64, False), (64, 3, 64, True)]


# quantkit.kernels.gluon_gemm (TMA form, x permuted by one Triton launch): BM, stages, rows, split-K
GG_CONFIGS = [(32, 6, 64, 1), (64, 4, 64, 1), (64, 3, 64, 1), (64, 4, 128, 1), (32, 6, 64, 2), (32, 6, 64, 4),
              (64, 4, 64, 4), (128, 4, 128, 1)]
ALL = False  # --all: also the probe's own kernels (x permuted by torch)


def _variants():
    """(label, fn(x, mw, out)) for every configuration."""
    from quantkit.kernels import gluon_gemm

    out = [(f"gg{cfg}", lambda x, mw, o, cfg=cfg: gluon_gemm.gemm(x, mw, None, o, *cfg)) for cfg in GG_CONFIGS]
    if ALL:
        out += [(str(cfg), lambda x, mw, o, cfg=cfg: gemm(x, mw, cfg[0], o, *cfg[1:])) for cfg in CONFIGS]
        out += [(f"tma{cfg}", lambda x, mw, o, cfg=cfg: gemm_tma(x, mw, *cfg, out=o)) for cfg in TMA_CONFIGS]
    return out


# BM, stages, split, rows, one barrier, asm dequantization — run 52's best first, then the variants
# queued for the next GPU run (bench/KERNELS_NOTES.md, item 53)
CONFIGS = [(64, 4, 1, 64, False, False), (64, 5, 1, 64, True, False), (64, 5, 1, 64, True, True),
           (64, 6, 1, 64, True, True), (64, 5, 1, 128, True, False), (64, 5, 1, 128, True, True),
           (32, 6, 1, 64, True, True), (32, 6, 1, 128, True, True), (128, 4, 1, 128, True, True),
           (256, 3, 1, 128, False, True), (64, 5, 2, 64, True, True)]


def main() -> None:
    from bench.kernel_timing import graph_us, rel_err
    from bench.kernels_mma import _rings, random_mw, reference
    from quantkit.kernels import dispatch, gluon_gemm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16,32,64,128,256,1024", help="rows of x")
    ap.add_argument("--out", type=Path, default=None, help="directory for gluon_probe.json")
    ap.add_argument("--launch", default=None, metavar="LABEL",
                    help="only launch the variant LABEL (as printed, e.g. 'tma(64, 4, 64, True)') five times on "
                         "--shape at the first of --ms, for Nsight Compute (bench/gluon_profile.sh)")
    ap.add_argument("--shape", default="qkv", help="with --launch: the Llama-2-7B linear")
    ap.add_argument("--all", action="store_true", help="also time the probe's own kernels (x permuted first)")
    args = ap.parse_args()
    global ALL
    ALL = args.all
    ms = [int(v) for v in args.ms.split(",")]
    if args.launch:
        from bench.kernel_candidates import SHAPES

        k, n = SHAPES[args.shape]
        fn = dict(_variants())[args.launch]
        mw = random_mw(k, n, 4, 128)
        x = torch.randn(ms[0], k, device="cuda", dtype=torch.float16)
        for _ in range(5):
            fn(x, mw, None)
        torch.cuda.synchronize()
        return
    fails, worst, per = 0, 0.0, {}
    for k, n, gs in ((4096, 1000, 128), (4096, 4096, 128), (11008, 4096, 128), (200, 136, -1), (1024, 520, 256)):
        mw = random_mw(k, n, 4, gs)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        for m in (1, 16, 17, 77, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference(x, mw, None)
            variants = _variants() + [("gg(32, 6, 64)+bias", lambda x, mw, o: gluon_gemm.gemm(x, mw, bias, o, 32, 6, 64)
                                       - bias), ("gg(32, 6, 64, 4)+bias", lambda x, mw, o:
                                                 gluon_gemm.gemm(x, mw, bias, o, 32, 6, 64, 4) - bias)]
            if k % 128:  # the probe's own kernels need whole K-tiles
                variants = [(label, fn) for label, fn in variants if label.startswith("gg")]
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
    print(f"check: {sum(map(len, per.values()))} cases, {fails} failures, worst {worst:.2e}", flush=True)
    rows = []
    for bits, _, shape, k, n, ring, fp16 in _rings([(4, ms)]):
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = {"shape": shape, "m": m, "fp16_us": graph_us([lambda w=w: F.linear(x, w) for w in fp16])}
            choice = dispatch.choice_for(ring[0], m, x.device)
            row["dispatch_us"] = graph_us([lambda mw=mw: dispatch.run(x, mw, None, choice) for mw in ring])
            row["permute_us"] = graph_us([lambda: permute_x(x)])
            xs = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(4)]
            row["permute_triton_us"] = graph_us([lambda xi=xi: gluon_gemm.permute_x(xi) for xi in xs])
            for label, fn in _variants():
                try:
                    row[label] = graph_us([lambda mw=mw, fn=fn: fn(x, mw, None) for mw in ring])
                except Exception as exc:
                    row[label] = float("nan")
                    print(f"{shape} M={m} {label}: {exc!r}"[:200], flush=True)
            labels = [label for label, _ in _variants()]
            best = min((row[label], label) for label in labels if row[label] == row[label])
            rows.append(row)
            if args.out:  # after every row, in case the run is cut short
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "gluon_probe.json").write_text(json.dumps({"check_failures": fails, "worst": worst,
                                                                       "rows": rows}, indent=1))
            print(f"{shape:7} M={m:4} fp16 {row['fp16_us']:6.1f} dispatch {row['dispatch_us']:6.1f} gluon "
                  + " ".join(f"{row[label]:6.1f}" for label in labels)
                  + f" -> best {best[1]} {row['fp16_us'] / best[0]:.2f}x fp16 "
                  f"(dispatch {row['fp16_us'] / row['dispatch_us']:.2f}x; permute_x {row['permute_us']:.1f}, "
                  f"Triton {row['permute_triton_us']:.1f})", flush=True)


if __name__ == "__main__":
    main()
