"""Probe (seventh session, compiled here, not yet run on a GPU): the Gluon W4 GEMM with the dequantized
weights staged through shared memory as the wgmma A operand, instead of held in registers.

quantkit/kernels/gluon_gemm.py keeps each K-step's dequantized weights in registers as the wgmma A
operand. That ties up two A-register sets (the in-flight wgmma still reads one, item 58), so a program
cannot take BM = 256 rows of x without spilling (255 registers, 348 bytes of spills), and M = 256
dequantizes every weight tile 2–4 times. It also needs x permuted into the words' input order (one
more launch per call, and ≈ 100 µs of eager host time for the pair).

Here each warp stores its dequantized values to a double-buffered shared-memory A tile in x's own
input order — a word's 8 values are 8 consecutive inputs, so one 16-byte store per word — and the
wgmma reads A and B (x, copied by TMA straight from x: no permutation) from shared memory. The
accumulator is the only large register tenant: BM = 256 fits (one pass over the weights at M ≤ 256).
Cost per K-step and warpgroup: 16 KB of shared-memory stores, a proxy fence and a barrier before the
wgmma (hidden under a 64 × 256 × 128 wgmma if the ring keeps up); compiled for sm_90a the step body
is 263 SASS instructions per thread at BM = 64 (register-A form: 238), 168 registers at BM = 256.

    from bench.gluon_smem_a import gemm_sa   # y = gemm_sa(x, mw, bias=None, out=None, bm=256, stages=2, rows=64)

Timed and checked by bench/gluon_probe.py (labels `sa(BM, stages, rows)`). Written against Triton
3.6's Gluon spelling through quantkit.kernels.gluon_gemm's shims.
"""

from __future__ import annotations

import torch
import triton

from quantkit.kernels import gluon_gemm as gg
from quantkit.kernels.gluon_gemm import TILE_K, gl, gluon
from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_mma import MmaWeights

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    TK = gg.TK

    @gluon.jit
    def _natural(w, z, s, ROWS: gl.constexpr):
        """[ROWS, 16] words → their dequantized values [ROWS, 128] in input order (word 4·t + c holds
        inputs 32·c + 8·t + o, o = 0 … 7: each thread's 8 values of a word are consecutive inputs)."""
        q = gl.inline_asm_elementwise(
            gg._ASM, gg._CONS,
            [w, gg._pair_bits(-(z + 1024).to(gl.float32)), gg._pair_bits(-(z + 64).to(gl.float32)),
             gg._pair_bits(s)],
            dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        v = gl.join(gl.join(gl.join(q[0], q[1]), gl.join(q[2], q[3])), gl.join(gl.join(q[4], q[5]), gl.join(q[6], q[7])))
        v = gl.reshape(v, [ROWS, 2, 2, 2, 2, 2, 2, 2])  # rows, t1 t0 c1 c0 (the word), o0 o1 o2 (the value)
        v = gl.permute(v, (0, 3, 4, 1, 2, 7, 6, 5))  # rows, c1 c0 t1 t0 o2 o1 o0: input order
        return gl.reshape(v, [ROWS, TK])

    @gluon.jit
    def w4_gemm_sa_kernel(x_desc, w_desc, s_ptr, z_ptr, b_ptr, out_ptr, M, N, KT, G, group_size: gl.constexpr,
                          BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, HAS_BIAS: gl.constexpr,
                          words_l: gl.constexpr):
        """out[m, n] = Σ_k x[m, k] · W[n, k] (+ b[n]) for ROWS weight rows and BM rows of x per program.
        x_desc: x itself, [M, K] fp16, boxes [BM, 128] (K past the end reads as zeros); w_desc as in
        gluon_gemm.w4_gemm_kernel."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        NWARP: gl.constexpr = ROWS // 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NWARP, 1],
                                                      instr_shape=[16, BM, 16])
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])
        a_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        rows = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, words_l))
        row_ok = rows < N
        xbuf = gl.allocate_shared_memory(gl.float16, [STAGES, BM, TK], x_desc.layout)
        wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS // 16, 256], w_desc.layout)
        abuf = gl.allocate_shared_memory(gl.float16, [2, ROWS, TK], a_s)  # A tiles of steps i, i − 1
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        fence_async_shared()
        gg._barrier()
        BYTES: gl.constexpr = BM * TK * 2 + ROWS * 16 * 4
        for j in gl.static_range(STAGES - 1):
            mbarrier.expect(ready.index(j), BYTES, pred=j < KT)
            gg._tma_load(x_desc, [pid_m * BM, j * TK], ready.index(j), xbuf.index(j), pred=j < KT)
            gg._tma_load(w_desc, [pid_n * (ROWS // 16), j * 256], ready.index(j), wbuf.index(j), pred=j < KT)
        acc = gl.zeros([ROWS, BM], gl.float32, layout=mma)
        s = gl.load(s_ptr + rows * G, mask=row_ok, other=0.0)[:, None]
        z = gl.load(z_ptr + rows * G, mask=row_ok, other=0).to(gl.int32)[:, None]
        for t in range(KT):
            slot = t % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            w = gg._words(wbuf.index(slot), ROWS, plain).load(words_l)
            a = abuf.index(t % 2)  # its last reader, step t − 2's wgmma, was retired at step t − 1
            a.store(_natural(w, z, s, ROWS))
            gi = gl.minimum((t + 1) * TK // group_size, G - 1)
            s = gl.load(s_ptr + rows * G + gi, mask=row_ok, other=0.0)[:, None]
            z = gl.load(z_ptr + rows * G + gi, mask=row_ok, other=0).to(gl.int32)[:, None]
            fence_async_shared()  # the stores are visible to the wgmma (async proxy) …
            gg._barrier()  # … from every thread of the warpgroup
            acc = warpgroup_mma(a, xbuf.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # step t − 1's wgmma is done
            gg._barrier()  # in every warp: the x slot of step t − 1 may be refilled
            nt = t + STAGES - 1
            ns = nt % STAGES
            mbarrier.expect(ready.index(ns), BYTES, pred=nt < KT)
            gg._tma_load(x_desc, [pid_m * BM, nt * TK], ready.index(ns), xbuf.index(ns), pred=nt < KT)
            gg._tma_load(w_desc, [pid_n * (ROWS // 16), nt * 256], ready.index(ns), wbuf.index(ns), pred=nt < KT)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
        orow = pid_n * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        ocol = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            acc = acc + gl.load(b_ptr + orow, mask=orow < N, other=0.0).to(gl.float32)[:, None]
        ptrs = out_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None]
        gl.store(ptrs, acc.to(gl.float16), mask=(orow < N)[:, None] & (ocol < M)[None, :])

    _SA = KeptKernel(w4_gemm_sa_kernel)


def gemm_sa(x: torch.Tensor, mw: MmaWeights, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
            bm: int = 256, stages: int = 2, rows: int = 64) -> torch.Tensor:
    """y = x Wᵀ (+ bias), fp16, through w4_gemm_sa_kernel: one launch, x as it is (K a multiple of 8)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = x.shape
    n = mw.out_features
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [bm, TILE_K], gg._X_LAYOUT)
    grid = (triton.cdiv(n, rows), triton.cdiv(m, bm))
    _SA(grid, (x_desc, gg._w_desc(mw, rows), mw.scales, mw.zeros, bias if bias is not None else out, out, m, n,
               triton.cdiv(k, TILE_K), mw.scales.shape[1], mw.group_size, bm, stages, rows, bias is not None,
               gg._WORDS_L[rows]), num_warps=rows // 16)
    return out
