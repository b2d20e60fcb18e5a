"""Split-K GEMV for small M: y = x Wᵀ with W 4- or 8-bit in the block-planar kernel layout.

One program owns BLOCK_N output columns of one row of x and a slice of K. Each step loads a
[BLOCK_N, 4·BLOCKS] tile of packed words (16-byte loads along K), splits it into its 32/b bit planes
and multiplies each plane with the four-input runs of x it meets (8-byte loads), in fp32 CUDA-core
FMAs: at M = 1 a tensor-core tile would be 15/16 padding. Integer → float costs one AND per value: a plane masked in place and read as fp32 bits is
the subnormal q·2^(pos−149), which the FMA takes at full speed (x is pre-scaled by 2^(100−pos)); the
zero point enters once per block as z·Σx. DENORMAL=False keeps the slower exponent trick
((q | 0x4B000000) as fp32 is 2^23 + q) for comparison. The scale multiplies once per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_layout import KernelWeights
from quantkit.kernels.triton_splitk import launch_buffers, store_tile


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K8, G, stride_xm, stride_om, group_size: tl.constexpr,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, SPLIT_K, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, DENORMAL: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK: tl.constexpr = 4 * PER_WORD  # inputs per 4-word block
    MASK: tl.constexpr = (1 << BITS) - 1
    TILE_W: tl.constexpr = 4 * BLOCKS
    HI_SHIFT: tl.constexpr = 12 if BITS == 4 else 16  # brings the planes above bit 23 down
    X_SCALE: tl.constexpr = 1.2676506002282294e30  # 2^100
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_i = tl.arange(0, TILE_W)
    k_in = (offs_i // 4) * BLOCK + offs_i % 4  # input of plane 0 of word i, from the tile's start
    offs_b = tl.arange(0, BLOCKS)
    span = tl.cdiv(tl.cdiv(K8, SPLIT_K), TILE_W) * TILE_W
    lo = pid_k * span
    hi = tl.minimum(lo + span, K8)
    x_row = x_ptr + pid_m * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K8
    sz_rows = offs_n[:, None] * G
    acc = tl.zeros([BLOCK_N, BLOCKS], dtype=tl.float32)
    # NUM_STAGES > 1: Triton streams the weight tiles through shared memory with cp.async, keeping
    # that many tiles in flight per program (what a GEMV needs to cover DRAM latency).
    for w0 in tl.range(lo, hi, TILE_W, num_stages=NUM_STAGES):
        # A 2-D load keeps consecutive words on consecutive lanes (16-byte, coalesced loads).
        i_ok = (w0 + offs_i) < hi
        wt = tl.load(w_rows + (w0 + offs_i)[None, :], mask=n_ok[:, None] & i_ok[None, :], other=0)
        wt = wt.to(tl.uint32, bitcast=True)
        blk = w0 + offs_b * 4
        sz = sz_rows + tl.minimum(blk * PER_WORD // group_size, G - 1)[None, :]
        s = tl.load(s_ptr + sz, mask=n_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=n_ok[:, None], other=0).to(tl.uint32)
        k0 = w0 * PER_WORD + k_in
        t = tl.zeros([BLOCK_N, TILE_W], dtype=tl.float32)
        xs = tl.zeros([TILE_W], dtype=tl.float32)
        w_hi = wt >> HI_SHIFT
        for j in tl.static_range(PER_WORD):
            kj = k0 + 4 * j
            xj = tl.load(x_row + kj, mask=i_ok & (kj < K), other=0.0).to(tl.float32)
            if DENORMAL:
                # Plane j masked in place, read as fp32 bits, is the subnormal q·2^(pos−149), which FMA
                # takes at full speed; x·2^(100−pos) makes every product q·x·2^-49, a normal float.
                if BITS * (j + 1) <= 23:
                    pos = BITS * j
                    qj = wt & (MASK << pos)
                else:
                    pos = BITS * j - HI_SHIFT
                    qj = w_hi & (MASK << pos)
                t += qj.to(tl.float32, bitcast=True) * (xj * (X_SCALE / (1 << pos)))[None, :]
                xs += xj
            else:
                qf = (((wt >> (BITS * j)) & MASK) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (qf - 8388608.0) * xj[None, :]
                xs += xj
        # Per block: s · (Σ q·x − z · Σ x); the block's 4 words are one thread's, so these sums are local.
        tb = tl.sum(tl.reshape(t, [BLOCK_N, BLOCKS, 4]), axis=2)
        xb = tl.sum(tl.reshape(xs, [BLOCKS, 4]), axis=1)
        if DENORMAL:
            acc += s * (tb - z.to(tl.float32, bitcast=True) * (xb * X_SCALE)[None, :])
        else:
            acc += s * (tb - z.to(tl.float32) * xb[None, :])
    part = tl.sum(acc, axis=1)
    if DENORMAL:
        part = part * 562949953421312.0  # 2^49 undoes 2^-149 · 2^100
    offs_m = pid_m + tl.arange(0, 1)
    tile_id = pid_m * tl.num_programs(1) + pid_n
    store_tile(part[None, :], offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr,
               tile_id, pid_k, SPLIT_K, SPLIT, HAS_BIAS)


_GEMV = KeptKernel(gemv_kernel)


def gemv(
    x: torch.Tensor,
    kw: KernelWeights,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    blocks: int = 16,
    split_k: int = 1,
    num_warps: int = 4,
    denormal: bool = True,
    num_stages: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) in x's dtype; one program per (row, column tile, K slice)."""
    n_tiles = triton.cdiv(kw.out_features, block_n)
    x, out, split_k, ws, cnt = launch_buffers(x, kw, out, split_k, blocks, x.shape[0] * n_tiles)
    m, k = x.shape
    _GEMV((m, n_tiles, split_k), (  # every parameter of gemv_kernel, in order
        x, kw.qweight, kw.scales, kw.zeros, bias if bias is not None else out, out, ws, cnt,
        m, kw.out_features, k, kw.qweight.shape[1], kw.scales.shape[1], x.stride(0), out.stride(0),
        kw.group_size, kw.bits, block_n, blocks, split_k, split_k > 1, bias is not None, denormal, num_stages,
    ), num_warps=num_warps, num_stages=num_stages)
    return out
