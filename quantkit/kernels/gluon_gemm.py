"""W4 (and W8) GEMM for 16 < M ≤ 512 on Hopper, written in Gluon (Triton's explicit-layout dialect): the
mma layout's words (triton_mma) become the wgmma A operand in registers, x the B operand from shared memory.

A program owns `rows` weight rows (64 per warpgroup of 4 warps) and a tile of BM rows of x, and walks
K in tiles of 128 inputs. Thread (g, t) of warp w loads the words of rows 16·w + g and 16·w + g + 8,
words 4·t … 4·t + 3 of each (16 bytes) — the words the wgmma A fragment needs, because the mma layout
was built for `mma.sync`'s identical fragment. Each word becomes four fp16 pairs with one `lop3` and
two `fma` per pair (DEQ_ASM, the GEMV's arithmetic: nibbles under the exponent of 1024, offset and
zero point off exactly, then the scale), and the pairs are relabelled by join / reshape / permute to
the fragment's input order, which the compiler proves free of data movement
(`convert_layout(assert_trivial=True)`).

That order within a 128-input tile is, high bit to low, c1 c0 h i t1 t0 e (word 4·t + c holds inputs
32·c + 8·t + o, o = 4·h + 2·i + e), so x must meet it: `permute_x` (one small Triton launch
in a CUDA graph) writes x in that order, and the GEMM's x tiles are then plain [BM, 128] boxes. Measured
alternatives, both slower (bench/KERNELS_NOTES.md): torch's permute-and-copy, and gathering x pair by
pair in the kernel (4-byte cp.async).

x tiles and word tiles go through a ring of `stages` shared-memory slots filled by the copy engine
(TMA), `stages − 1` tiles ahead, one mbarrier per slot; the wgmma of step t runs asynchronously while
step t + 1's words are dequantized (one group in flight), so consecutive steps must hold their A
operands in different registers: the K loop runs two steps per iteration. fp32 accumulation,
fp16 output, optional bias. Layers too narrow to fill the GPU split K over 2–8 programs per output
tile, summed by the last of them in the same launch. 4- or 8-bit weights, group sizes that
are multiples of 128 (or one group per row), fp16 activations; sm_90 only (wgmma, TMA). Measured and
not kept: K-tiles as two 64-input wgmma groups, and a producer warp issuing the copies
(`gl.warp_specialize`) — both correct, neither faster.

8-bit words: thread (g, t) holds words 8·t … 8·t + 7 (word 8·t + 2·c + h holds inputs 32·c + 8·t +
4·h + byte), one `prmt` and two `fma` per fp16 pair (DEQ8_ASM, the W8 GEMV's arithmetic); its dot
order is the 4-bit one with the byte's high bit in place of i, so `permute_x` serves both. A slot's
8-bit block is [row half, chunk, g, t, 4 words] in memory, copied as a 3-D TMA box (`w_box`: a box is
at most 256 wide, so a 2-D [rows / 16, 512] box would arrive as two copies one after the other, not
row-major), viewed as [ROWS / 8, 2, 128] and relabelled to (row, word) without data movement; the
dispatch takes it for 16 < M ≤ 512, to 1024 on wide layers (the W8 Gluon rows of kernels/dispatch_table.py).
The Gluon API is experimental: this module is
written against the Triton 3.6 and 3.9 spellings and reports itself unavailable where the import
fails. Figures: BENCHMARKS.md ("Kernels"); the variants tried: bench/KERNELS_NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel, interpreted
from quantkit.kernels.triton_mma import MmaWeights
from quantkit.kernels.triton_splitk import clamp_split, counters, workspace

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon
    gluon = None

TILE_K = 128

# The eight values of a word in fp16 pairs (triton_mma's arithmetic): one lop3 puts nibbles p and
# p + 4 under the exponent of 1024 (odd p in place, reading 1024 + 16·q); an fma takes 1024 + z off
# (odd p: scales by 1/16 and takes 64 + z off), exact; an fma by the scale (c = −0: a plain product).
# Pairs (o, o + 1) for o = 0, 2, 4, 6 come from nibbles 0/4, 2/6, 1/5, 3/7. Inputs: the word,
# −(1024 + z), −(64 + z) and s as fp16 pairs; outputs: the values of input offsets o = 0 … 7.
DEQ_ASM = """{
.reg .b32 p, q, one, sixteenth, nzero;
mov.b32 one, 0x3C003C00;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 nzero, 0x80008000;
lop3.b32 p, $8, 0x000F000F, 0x64006400, 0xEA;
fma.rn.f16x2 p, p, one, $9;
fma.rn.f16x2 p, p, $11, nzero;
mov.b32 {$0, $1}, p;
shr.b32 q, $8, 8;
lop3.b32 p, q, 0x000F000F, 0x64006400, 0xEA;
fma.rn.f16x2 p, p, one, $9;
fma.rn.f16x2 p, p, $11, nzero;
mov.b32 {$2, $3}, p;
lop3.b32 p, $8, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 p, p, sixteenth, $10;
fma.rn.f16x2 p, p, $11, nzero;
mov.b32 {$4, $5}, p;
lop3.b32 p, q, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 p, p, sixteenth, $10;
fma.rn.f16x2 p, p, $11, nzero;
mov.b32 {$6, $7}, p;
}"""
DEQ_CONS = "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r"

# The four values of an 8-bit word (triton_mma's W8 arithmetic): one prmt puts bytes 0 and 1 (then 2
# and 3) under the exponent of 1024, an fma takes 1024 + z off (exact), an fma by the scale. Inputs:
# the word, −(1024 + z) and s as fp16 pairs; outputs: the values of bytes 0 … 3.
DEQ8_ASM = """{
.reg .b32 p, one, nzero;
mov.b32 one, 0x3C003C00;
mov.b32 nzero, 0x80008000;
prmt.b32 p, $4, 0x64646464, 0x4140;
fma.rn.f16x2 p, p, one, $5;
fma.rn.f16x2 p, p, $6, nzero;
mov.b32 {$0, $1}, p;
prmt.b32 p, $4, 0x64646464, 0x4342;
fma.rn.f16x2 p, p, one, $5;
fma.rn.f16x2 p, p, $6, nzero;
mov.b32 {$2, $3}, p;
}"""
DEQ8_CONS = "=h,=h,=h,=h,r,r,r"


if gluon is not None:
    _ASM = gl.constexpr(DEQ_ASM)
    _CONS = gl.constexpr(DEQ_CONS)
    _ASM8 = gl.constexpr(DEQ8_ASM)
    _CONS8 = gl.constexpr(DEQ8_CONS)
    TK = gl.constexpr(TILE_K)
    # Spellings that moved between Triton 3.6 and 3.9 (Gluon is experimental)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the CTA barrier
    _REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # public from 3.9

    @gluon.jit
    def _view(buf, shape: gl.constexpr, layout: gl.constexpr):
        """A TMA slot of words viewed with another shape and shared layout (same bytes)."""
        if _REINTERPRET:
            return buf.reinterpret(gl.int32, shape, layout)
        else:
            return buf._reinterpret(gl.int32, shape, layout)

    @gluon.jit
    def _words(buf, ROWS: gl.constexpr, BITS: gl.constexpr, load_l: gl.constexpr, words_l: gl.constexpr):
        """A slot of words (one K-tile of ROWS rows as the copy engine wrote it, ROWS / 16 blocks) as the
        [ROWS, 128 · BITS / 32] word tile in words_l. W4: a block is row-major [16 rows, 16 words]. W8: a
        block is [row half, chunk v, row g, t, 4 words] (row 8·half + g, word 8·t + 4·v + i), viewed as
        [ROWS / 8, 2, 128] and relabelled to (row, word) without data movement."""
        if BITS == 4:
            plain: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])
            return _view(buf, [ROWS, 16], plain).load(load_l)
        else:
            plain3: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[2, 1, 0])
            w = _view(buf, [ROWS // 8, 2, 128], plain3).load(load_l)
            w = gl.reshape(w, [ROWS // 16, 2, 2, 8, 4, 4])  # row tile, half, v, g, t, i
            w = gl.permute(w, (0, 1, 3, 4, 2, 5))  # row tile, half, g (the row); t, v, i (the word)
            return gl.convert_layout(gl.reshape(w, [ROWS, 32]), words_l, assert_trivial=True)

    @gluon.jit
    def _pair_bits(v):
        """fp16 values as int32 words holding them in both halves."""
        b = v.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return b | (b << 16)

    @gluon.jit
    def _values(w, z, s, BITS: gl.constexpr):
        """Words (zero points z int32 and scales s fp16, [rows, 1]) → their dequantized values, [rows, words,
        2, 2, 2] (W4: value bits e, i, h of the word's input offset 4·h + 2·i + e) or [rows, words, 2, 2]
        (W8: byte bits 0, 1)."""
        if BITS == 4:
            q = gl.inline_asm_elementwise(
                _ASM, _CONS,
                [w, _pair_bits(-(z + 1024).to(gl.float32)), _pair_bits(-(z + 64).to(gl.float32)), _pair_bits(s)],
                dtype=(gl.float16,) * 8, is_pure=True, pack=1)
            return gl.join(gl.join(gl.join(q[0], q[1]), gl.join(q[2], q[3])),
                           gl.join(gl.join(q[4], q[5]), gl.join(q[6], q[7])))
        else:
            q = gl.inline_asm_elementwise(_ASM8, _CONS8, [w, _pair_bits(-(z + 1024).to(gl.float32)), _pair_bits(s)],
                                          dtype=(gl.float16,) * 4, is_pure=True, pack=1)
            return gl.join(gl.join(q[0], q[1]), gl.join(q[2], q[3]))

    @gluon.jit
    def _a_operand(w, z, s, a_l: gl.constexpr, ROWS: gl.constexpr):
        """[ROWS, 16] words (zero points z int32 and scales s fp16, [ROWS, 1]) → the [ROWS, 128] wgmma A
        operand in dot order, without data movement."""
        # rows, t1 t0 c1 c0 (the word), e i h (the value)
        v = gl.reshape(_values(w, z, s, 4), [ROWS, 2, 2, 2, 2, 2, 2, 2])
        v = gl.permute(v, (0, 3, 4, 7, 6, 1, 2, 5))  # rows, c1 c0 h i t1 t0 e
        return gl.convert_layout(gl.reshape(v, [ROWS, TK]), a_l, assert_trivial=True)

    @gluon.jit
    def _a_operand8(w, z, s, a_l: gl.constexpr, ROWS: gl.constexpr):
        """[ROWS, 32] 8-bit words (word 8·t + 2·c + h holds inputs 32·c + 8·t + 4·h + byte) → the [ROWS,
        128] wgmma A operand in the same dot order as the 4-bit one (c1 c0 h, byte bit 1, t1 t0, byte
        bit 0), so x is permuted alike."""
        # rows, t, c, h (the word), e, byte bit 1 (the value)
        v = gl.reshape(_values(w, z, s, 8), [ROWS, 4, 4, 2, 2, 2])
        v = gl.permute(v, (0, 2, 3, 5, 1, 4))  # rows, c, h, byte bit 1, t, e
        return gl.convert_layout(gl.reshape(v, [ROWS, TK]), a_l, assert_trivial=True)

    @gluon.jit
    def _step(i, k0, NK, acc, s, z, xbuf, wbuf, ready, x_desc, w_desc, s_ptr, z_ptr, rows, row_ok, G, pid_m, pid_n,
              group_size: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
              BYTES: gl.constexpr, BITS: gl.constexpr, load_l: gl.constexpr, words_l: gl.constexpr,
              a_l: gl.constexpr):
        """Step i of the K loop (K-tile k0 + i): wait for its slot, dequantize its words (scales s, zero
        points z), start its wgmma, retire step i − 1's, refill that step's slot with K-tile i + STAGES − 1.
        Returns the accumulator and the next step's scales and zero points."""
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a = _a_tile(wbuf.index(slot), z, s, ROWS, BITS, load_l, words_l, a_l)
        s, z = _scales(k0 + i + 1, s_ptr, z_ptr, rows, row_ok, G, group_size)  # the next step's, a step ahead
        acc = warpgroup_mma(a, xbuf.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # step i − 1's wgmma is done
        _refill(i, k0, NK, xbuf, wbuf, ready, x_desc, w_desc, pid_m, pid_n, BM, STAGES, ROWS, BYTES, BITS)
        return acc, s, z

    @gluon.jit
    def _a_tile(wslot, z, s, ROWS: gl.constexpr, BITS: gl.constexpr, load_l: gl.constexpr, words_l: gl.constexpr,
                a_l: gl.constexpr):
        """A slot's words (one K-tile) → the [ROWS, 128] wgmma A operand (scales s, zero points z)."""
        w = _words(wslot, ROWS, BITS, load_l, words_l)
        if BITS == 4:
            return _a_operand(w, z, s, a_l, ROWS)
        else:
            return _a_operand8(w, z, s, a_l, ROWS)

    @gluon.jit
    def _scales(t, s_ptr, z_ptr, rows, row_ok, G, group_size: gl.constexpr):
        """The scales and zero points ([rows, 1]; fp16, int32) of K-tile t (clamped to the last group)."""
        gi = gl.minimum(t * TK // group_size, G - 1)
        s = gl.load(s_ptr + rows * G + gi, mask=row_ok, other=0.0)[:, None]
        z = gl.load(z_ptr + rows * G + gi, mask=row_ok, other=0).to(gl.int32)[:, None]
        return s, z

    @gluon.jit
    def _refill(i, k0, NK, xbuf, wbuf, ready, x_desc, w_desc, pid_m, pid_n, BM: gl.constexpr, STAGES: gl.constexpr,
                ROWS: gl.constexpr, BYTES: gl.constexpr, BITS: gl.constexpr):
        """After step i's wait retired step i − 1's wgmma in this warp: once every warp has (the CTA barrier,
        which also means every warp has read its words of step i − 1), refill that step's slot with K-tile
        k0 + i + STAGES − 1 if there is one."""
        _barrier()
        ni = i + STAGES - 1  # into the slot of step i − 1
        ns = ni % STAGES
        mbarrier.expect(ready.index(ns), BYTES, pred=ni < NK)
        _tma_load(x_desc, [pid_m * BM, (k0 + ni) * TK], ready.index(ns), xbuf.index(ns), pred=ni < NK)
        _w_load(w_desc, pid_n, k0 + ni, ready.index(ns), wbuf.index(ns), ni < NK, ROWS, BITS)

    @gluon.jit
    def _ring(x_desc, w_desc, BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, BITS: gl.constexpr):
        """The ring's shared memory: STAGES slots of x tiles [BM, 128] and of word boxes (`w_box`)."""
        BLOCK: gl.constexpr = 16 * TK * BITS // 32
        xbuf = gl.allocate_shared_memory(gl.float16, [STAGES, BM, TK], x_desc.layout)
        if BITS == 4:
            wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS // 16, BLOCK], w_desc.layout)
        else:
            wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS // 16, 2, BLOCK // 2], w_desc.layout)
        return xbuf, wbuf

    @gluon.jit
    def _w_load(w_desc, pid_n, t, bar, dst, pred, ROWS: gl.constexpr, BITS: gl.constexpr):
        """Copy K-tile t of the program's ROWS rows of words into slot dst (boxes: `w_box`)."""
        if BITS == 4:
            _tma_load(w_desc, [pid_n * (ROWS // 16), t * 256], bar, dst, pred=pred)
        else:
            _tma_load(w_desc, [pid_n * (ROWS // 16), t * 2, 0], bar, dst, pred=pred)

    @gluon.jit
    def gemm_kernel(x_desc, w_desc, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, KT, G,
                    group_size: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
                    HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, BITS: gl.constexpr, load_l: gl.constexpr,
                    words_l: gl.constexpr):
        """out[m, n] = Σ_k x[m, k] · W[n, k] (+ b[n]) for the program's ROWS weight rows and BM rows of x.
        x_desc: x permuted (`permute_x`), [M, KT · 128] fp16, boxes [BM, 128]; w_desc: the words, boxes of
        one K-tile of ROWS rows (`_w_load`); load_l / words_l: the
        register layouts of a slot's view and of the [ROWS, 128 · BITS / 32] word tile (`words_layouts`).
        SPLIT > 1: the programs of grid axis 2 share K; each writes its fp32 partial sums to
        ws_ptr[pid_k] ([SPLIT, M, N]) and counts itself in cnt_ptr[output tile] (int32, zero before the
        launch); the last to arrive adds all the partials in K order (the same result whichever arrives
        last), the bias, writes out and sets the count back to zero for the next launch."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        per = gl.cdiv(KT, SPLIT)  # SPLIT > 1: this program's K-tiles k0 … k0 + NK − 1
        k0 = gl.program_id(2) * per
        NK = gl.minimum(per, KT - k0)
        NWARP: gl.constexpr = ROWS // 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARP, 1],
                                                      instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)  # [ROWS, 128]
        rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, words_l))
        row_ok = rows < N
        BLOCK: gl.constexpr = 16 * TK * BITS // 32  # words of one K-tile of a 16-row tile
        xbuf, wbuf = _ring(x_desc, w_desc, BM, STAGES, ROWS, BITS)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        fence_async_shared()  # the barriers are initialised for the copy engine and for every warp before
        _barrier()  # any waits: without this, warps could read a stale barrier left by an earlier program
        BYTES: gl.constexpr = BM * TK * 2 + ROWS * BLOCK * 4 // 16
        for j in gl.static_range(STAGES - 1):  # K-tiles 0 … STAGES − 2
            mbarrier.expect(ready.index(j), BYTES, pred=j < NK)
            _tma_load(x_desc, [pid_m * BM, (k0 + j) * TK], ready.index(j), xbuf.index(j), pred=j < NK)
            _w_load(w_desc, pid_n, k0 + j, ready.index(j), wbuf.index(j), j < NK, ROWS, BITS)
        acc = gl.zeros([ROWS, BM], gl.float32, layout=mma)
        s, z = _scales(k0, s_ptr, z_ptr, rows, row_ok, G, group_size)
        # Two steps per iteration, so that consecutive steps' A operands are different registers: the
        # wgmma of step t still reads its A registers while step t + 1 dequantizes, and with one step
        # per iteration the next step wrote the same registers (results corrupted now and then at BM =
        # 64, where the wgmma runs longest; see bench/KERNELS_NOTES.md).
        for i in range(0, NK - 1, 2):
            acc, s, z = _step(i, k0, NK, acc, s, z, xbuf, wbuf, ready, x_desc, w_desc, s_ptr, z_ptr, rows, row_ok,
                              G, pid_m, pid_n, group_size, BM, STAGES, ROWS, BYTES, BITS, load_l, words_l, a_l)
            acc, s, z = _step(i + 1, k0, NK, acc, s, z, xbuf, wbuf, ready, x_desc, w_desc, s_ptr, z_ptr, rows,
                              row_ok, G, pid_m, pid_n, group_size, BM, STAGES, ROWS, BYTES, BITS, load_l, words_l, a_l)
        if NK % 2 == 1:
            acc, s, z = _step(NK - 1, k0, NK, acc, s, z, xbuf, wbuf, ready, x_desc, w_desc, s_ptr, z_ptr, rows,
                              row_ok, G, pid_m, pid_n, group_size, BM, STAGES, ROWS, BYTES, BITS, load_l, words_l, a_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
        orow = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        ocol = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        ptrs = out_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None]
        omask = (orow < N)[:, None] & (ocol < M)[None, :]
        if SPLIT > 1:
            pid_k = gl.program_id(2)
            part = ocol.to(gl.int64)[None, :] * N + orow[:, None]
            gl.store(ws_ptr + pid_k * M * N + part, acc, mask=omask)
            _barrier()  # every warp's partial sums are written before the count (release, GPU scope)
            tile = cnt_ptr + pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:  # the last program of this output tile: the others' sums are visible
                # added in the order of K whichever program arrives last, so results are reproducible
                total = gl.zeros([ROWS, BM], gl.float32, layout=mma)
                for j in gl.static_range(SPLIT):
                    other = gl.load(ws_ptr + j * M * N + part, mask=omask & (j != pid_k), other=0.0,
                                    cache_modifier=".cg")
                    total += gl.where(pid_k == j, acc, other)
                if HAS_BIAS:
                    total = total + gl.load(b_ptr + orow, mask=orow < N, other=0.0).to(gl.float32)[:, None]
                gl.store(ptrs, total.to(gl.float16), mask=omask)
                gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc = acc + gl.load(b_ptr + orow, mask=orow < N, other=0.0).to(gl.float32)[:, None]
            gl.store(ptrs, acc.to(gl.float16), mask=omask)

    def words_layouts(rows: int, bits: int) -> tuple:
        """(layout a slot's view is loaded in, layout of the [rows, 128 · bits / 32] word tile) for a
        program of `rows` weight rows. Thread (g, t) of warp w holds rows 16·w + g and 16·w + g + 8 and,
        of each, the words the wgmma A fragment needs: 4·t … 4·t + 3 (W4; register bits: word 1, 2, row
        8; lane bits: word 4, 8, row 1, 2, 4) or 8·t … 8·t + 7 (W8; registers: word 1, 2, 4, row 8; lanes:
        word 8, 16, row 1, 2, 4); warp bits: row 16, 32, …. W8 loads its [rows / 8, 2, 128] view of the
        slot (`_words`) with the same bits in memory order."""
        warps = [[16 << i, 0] for i in range(rows.bit_length() - 5)]
        if bits == 4:
            words = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                               lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                               warp_bases=warps, block_bases=[], shape=[rows, 16])
            return words, words
        words = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                           lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                           warp_bases=warps, block_bases=[], shape=[rows, 32])
        view = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 0, 0]],
                                          lane_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
                                          warp_bases=[[2 << i, 0, 0] for i in range(rows.bit_length() - 5)],
                                          block_bases=[], shape=[rows // 8, 2, 128])
        return view, words

    _LAYOUTS = {(rows, bits): words_layouts(rows, bits) for rows in (64, 128) for bits in (4, 8)}
    _X_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _aligned(x: torch.Tensor, align: int) -> torch.Tensor:
    """x itself if its rows are contiguous and every row starts `align`-byte aligned, else a fresh copy."""
    size = x.element_size()
    if x.stride(1) == 1 and (x.stride(0) * size) % align == 0 and x.data_ptr() % align == 0:
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def supports(mw: MmaWeights, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this kernel takes the layer: Gluon present, a Hopper GPU (not the interpreter), 4- or
    8-bit weights in whole 128-input groups (or one group per row), fp16 activations, K a multiple of 8."""
    if gluon is None or interpreted() or device.type != "cuda" or dtype != torch.float16:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    groups = mw.scales.shape[1]
    return mw.bits in (4, 8) and (groups == 1 or mw.group_size % TILE_K == 0) and mw.in_features % 8 == 0


def w_box(rows: int, bits: int) -> tuple[list[int], object]:
    """(box, shared layout) of the words' TMA descriptor for programs of `rows` rows: one K-tile of rows /
    16 row tiles, [rows / 16, 256] words (W4) or [rows / 16, 2, 256] (W8 over qweight viewed as [row
    tiles, K-tiles · 2, 256]: a TMA box is at most 256 wide, and a wider one is split into messages
    stacked in shared memory, not the row-major block `_words` reads; `_w_load`)."""
    box = [rows // 16, 256] if bits == 4 else [rows // 16, 2, 256]
    return box, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(box))


def _w_desc(mw: MmaWeights, rows: int):
    """The TMA descriptor of the layer's words for programs of `rows` rows (`w_box`), made once per layer."""
    descs = mw.__dict__.setdefault("tma_descs", {})
    if rows not in descs:
        box, layout = w_box(rows, mw.bits)
        words = mw.qweight if len(box) == 2 else mw.qweight.view(mw.qweight.shape[0], -1, 256)
        descs[rows] = TensorDescriptor.from_tensor(words, box, layout)
    return descs[rows]


def gemm(x: torch.Tensor, mw: MmaWeights, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         bm: int = 64, stages: int = 4, rows: int = 64, split: int = 1) -> torch.Tensor | None:
    """y = x Wᵀ (+ bias) in fp16 for x [M, K] fp16 and 4- or 8-bit weights in the mma layout (`supports`):
    x is permuted into the dot order (`permute_x`, one launch), then one GEMM launch (`out`, if given,
    may be strided: it is then written through a copy). bm: rows of x per program (16 … 256); stages:
    ring slots; rows: weight rows per program (64 per warpgroup); split: programs sharing each output
    tile's K, for layers too narrow to fill the GPU (fp32 partial sums through a [split, M, N] workspace,
    added by the last program of each tile, in the same launch).

    None, launching nothing, while a CUDA graph is being captured if either launch has not run before
    with these arguments: its first launch would load a module, which capture forbids (the caller then
    takes another kernel; `capture.graph_warmup` makes the warm-up before a capture launch this one)."""
    m = x.shape[0]
    n = mw.out_features
    if out is not None and not out.is_contiguous():  # the kernel writes rows N apart
        y = gemm(x, mw, bias, None, bm, stages, rows, split)
        return None if y is None else out.copy_(y)
    capturing = torch.cuda.is_current_stream_capturing()
    xp, permute_grid, permute_args = _permute_launch(x)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    kt = xp.shape[1] // TILE_K
    grid = (triton.cdiv(n, rows), triton.cdiv(m, bm), clamp_split(max(1, min(split, kt)), m, n))
    # split K: the tile counters of triton_splitk (one per output tile; each launch leaves them zero),
    # never made during a capture (they would be graph memory: then the launch does not split)
    counts = counters(x.device, grid[0] * grid[1], make=not capturing) if grid[2] > 1 else None
    if counts is None:
        grid = grid[:2] + (1,)
    ws = workspace(grid[2], m, n, x.device) if grid[2] > 1 else out
    x_desc = TensorDescriptor.from_tensor(xp, [bm, TILE_K], _X_LAYOUT)
    args = (x_desc, _w_desc(mw, rows), mw.scales, mw.zeros, bias if bias is not None else out, out, ws,
            counts if counts is not None else out, m, n, kt, mw.scales.shape[1], mw.group_size, bm, stages, rows,
            bias is not None, grid[2], mw.bits, *_LAYOUTS[(rows, mw.bits)])
    if capturing and not (
            _PERMUTE.kept_for(permute_args) and _GEMM.kept_for(args, num_warps=rows // 16)):
        return None
    _PERMUTE(permute_grid, permute_args)
    _GEMM(grid, args, num_warps=rows // 16)
    return out


@triton.jit
def _permute_kernel(x_ptr, xp_ptr, K2, KP2, x_stride, xp_stride, BLOCK: tl.constexpr):
    """xp[m, d] = x[m, natural pair of d] over int32 pairs (K2 of them), zeros from K2 to KP2."""
    m = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = (d & ~63) | (d & 48) | ((d & 3) << 2) | ((d >> 2) & 3)
    v = tl.load(x_ptr + m * x_stride + src, mask=src < K2, other=0)
    tl.store(xp_ptr + m * xp_stride + d, v, mask=d < KP2)


# Launched through KeptKernel (launch.py): after the first call with a signature, the compiled kernel
# is called directly, skipping the JIT front end's argument binding (with the Gluon kernel's layout
# constexprs and descriptors, more host time per eager call than the GEMM itself takes).
_PERMUTE = KeptKernel(_permute_kernel)
_GEMM = KeptKernel(gemm_kernel) if gluon is not None else None


def _permute_launch(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], tuple]:
    """(the output of `permute_x`, allocated, and the grid and arguments of its launch)."""
    m, k = x.shape
    x = _aligned(x, 4)
    kp = triton.cdiv(k, TILE_K) * TILE_K
    xp = torch.empty(m, kp, dtype=torch.float16, device=x.device)
    block = min(2048, triton.next_power_of_2(kp // 2))
    xi, xpi = x.view(torch.int32), xp.view(torch.int32)
    return xp, (m, triton.cdiv(kp // 2, block)), (xi, xpi, k // 2, kp // 2, xi.stride(0), xpi.stride(0), block)


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp16 → [M, KT · 128] fp16 with each 128-input tile in the dot order (c1 c0 h i t1 t0 e),
    zero-padded: one Triton launch."""
    xp, grid, args = _permute_launch(x)
    _PERMUTE(grid, args)
    return xp
