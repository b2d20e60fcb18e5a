"""Tensor-core GEMM for M ≥ 2, and a dequantize kernel for the dequantize-then-cuBLAS path.

The GEMM dequantizes each tile of packed words plane by plane (see triton_layout: plane j of a tile
holds the inputs 4·j + w of each 4-word block) and feeds every plane to `tl.dot` with the matching
columns of x, accumulating in fp32. With fp16 activations the dequantization stays in fp16:
(q | 0x6400) read as fp16 is 1024 + q, so subtracting 1024 + z is exact and one multiply by the fp16
scale rounds once, like the reference. With bf16 it goes through fp32 (2^23 + q) and rounds once to
bf16. SWAP_AB computes (W xᵀ)ᵀ: the dequantized tile is then the register operand of Hopper's wgmma
and a small M the narrow side of the tile (the tuned choice at every M measured). Split-K as in
triton_splitk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_layout import KernelWeights
from quantkit.kernels.triton_splitk import launch_buffers, store_tile


@triton.jit
def dequant_values(q, zb, s, HALF: tl.constexpr, dtype: tl.constexpr):
    """Integers q (already masked) as W values in `dtype`; zb = bias + z and s broadcast to q."""
    if HALF:
        return ((q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - zb) * s
    return (((q | 0x4B000000).to(tl.float32, bitcast=True) - zb) * s).to(dtype)


@triton.jit
def _dequant_plane(wt, j, zb, s, BITS: tl.constexpr, HALF: tl.constexpr, dtype: tl.constexpr):
    """Plane j of a word tile as W values in `dtype` (zb = bias + z and s broadcast to wt's shape)."""
    return dequant_values((wt >> (BITS * j)) & ((1 << BITS) - 1), zb, s, HALF, dtype)


@triton.jit
def zero_bias_scale(s, z, HALF: tl.constexpr):
    """(bias + z, s) for `dequant_values`: fp16 (1024 + z, s) or fp32 (2^23 + z, s as fp32)."""
    if HALF:
        zb = (z + 1024).to(tl.float16)
    else:
        zb = (z + 8388608).to(tl.float32)
        s = s.to(tl.float32)
    return zb, s


@triton.jit
def _block_scales(s_ptr, z_ptr, offs_n, n_ok, blk, G, group_size: tl.constexpr, PER_WORD: tl.constexpr,
                  HALF: tl.constexpr):
    """Scale and bias + zero [BN, len(blk)] of the 4-word blocks starting at words `blk` (a block lies in one
    group; a word tile passes each word's block start)."""
    sz = offs_n[:, None] * G + tl.minimum(blk * PER_WORD // group_size, G - 1)[None, :]
    s = tl.load(s_ptr + sz, mask=n_ok[:, None], other=0.0)
    z = tl.load(z_ptr + sz, mask=n_ok[:, None], other=0).to(tl.int32)
    return zero_bias_scale(s, z, HALF)


@triton.jit
def _load_words(w_ptr, s_ptr, z_ptr, offs_n, n_ok, w0, hi, K8, G, group_size: tl.constexpr,
                PER_WORD: tl.constexpr, TILE_W: tl.constexpr, HALF: tl.constexpr):
    """A [BN, TILE_W] tile of words from word w0 on, with each word's scale and bias + zero."""
    offs_i = tl.arange(0, TILE_W)
    words = w0 + offs_i
    ok = n_ok[:, None] & (words < hi)[None, :]
    wt = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K8 + words[None, :], mask=ok, other=0)
    # Four consecutive words form a block of one group: 4·(32/b) inputs, and 32 divides every group.
    zb, s = _block_scales(s_ptr, z_ptr, offs_n, n_ok, w0 + (offs_i // 4) * 4, G, group_size, PER_WORD, HALF)
    return wt, zb, s


@triton.jit
def _load_blocks(w_ptr, s_ptr, z_ptr, offs_n, n_ok, w0, hi, K8, G, group_size: tl.constexpr,
                 PER_WORD: tl.constexpr, BLOCKS: tl.constexpr, HALF: tl.constexpr):
    """The same tile as [BN, BLOCKS, 4] with one scale and zero per block (the swapped path's shape)."""
    blk = w0 + tl.arange(0, BLOCKS) * 4
    words = blk[:, None] + tl.arange(0, 4)[None, :]
    wt = tl.load(w_ptr + offs_n.to(tl.int64)[:, None, None] * K8 + words[None, :, :],
                 mask=n_ok[:, None, None] & (blk < hi)[None, :, None], other=0)
    zb, s = _block_scales(s_ptr, z_ptr, offs_n, n_ok, blk, G, group_size, PER_WORD, HALF)
    return wt, zb[:, :, None], s[:, :, None]


@triton.jit
def gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, K8, G, stride_xm, stride_om, group_size: tl.constexpr,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    SPLIT_K, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # neighbouring programs share a weight tile: it is read once from DRAM
    pid_n = pid // num_m
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK: tl.constexpr = 4 * PER_WORD
    TILE_W: tl.constexpr = 4 * BLOCKS
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    span = tl.cdiv(tl.cdiv(K8, SPLIT_K), TILE_W) * TILE_W
    lo = pid_k * span
    hi = tl.minimum(lo + span, K8)
    offs_i = tl.arange(0, TILE_W)
    k_in = (offs_i // 4) * BLOCK + offs_i % 4
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(lo, hi, TILE_W):
        if SWAP_AB:  # this shape lets the dequantized tile feed the tensor cores from registers
            wt, zb, s = _load_blocks(w_ptr, s_ptr, z_ptr, offs_n, n_ok, w0, hi, K8, G, group_size, PER_WORD, BLOCKS, HALF)
        else:
            wt, zb, s = _load_words(w_ptr, s_ptr, z_ptr, offs_n, n_ok, w0, hi, K8, G, group_size, PER_WORD, TILE_W, HALF)
        k0 = w0 * PER_WORD + k_in  # [TILE_W]: input of plane 0 of each word
        kw_ok = (w0 + offs_i) < hi
        for j in tl.static_range(PER_WORD):
            kj = k0 + 4 * j
            xj = tl.load(x_rows + kj[None, :], mask=m_ok[:, None] & (kw_ok & (kj < K))[None, :], other=0.0)
            wj = _dequant_plane(wt, j, zb, s, BITS, HALF, dtype)
            if SWAP_AB:
                acc = tl.dot(wj.reshape(BLOCK_N, TILE_W), tl.trans(xj), acc)
            else:
                acc = tl.dot(xj, tl.trans(wj), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    store_tile(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr,
               pid, pid_k, SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, K8, G, group_size: tl.constexpr,
                   BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK: tl.constexpr = 4 * PER_WORD
    TILE_W: tl.constexpr = 4 * BLOCKS
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w0 = pid_k * TILE_W
    # A [BN, BLOCKS, 4·(32/b)] tile in K order: element c of block blk is input 4·(c // 4) + c % 4,
    # i.e. bit plane c // 4 of word c % 4. Each thread reads its 4 words (one 16-byte load, again for
    # every plane: L1 hits) and stores runs of consecutive values (16-byte stores), not plane by plane.
    blk = w0 + tl.arange(0, BLOCKS) * 4
    c = tl.arange(0, BLOCK)
    words = blk[None, :, None] + (c % 4)[None, None, :]
    ok = n_ok[:, None, None] & (blk < K8)[None, :, None]
    wt = tl.load(w_ptr + offs_n.to(tl.int64)[:, None, None] * K8 + words, mask=ok, other=0)
    q = (wt >> (BITS * (c // 4))[None, None, :]) & ((1 << BITS) - 1)
    zb, s = _block_scales(s_ptr, z_ptr, offs_n, n_ok, blk, G, group_size, PER_WORD, HALF)
    w = dequant_values(q, zb[:, :, None], s[:, :, None], HALF, dtype)
    offs_k = blk[:, None] * PER_WORD + c[None, :]
    rows = out_ptr + offs_n.to(tl.int64)[:, None, None] * K
    tl.store(rows + offs_k[None, :, :], w, mask=ok & (offs_k < K)[None, :, :])


_GEMM = KeptKernel(gemm_kernel)


def gemm(
    x: torch.Tensor,
    kw: KernelWeights,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = 16,
    block_n: int = 64,
    blocks: int = 8,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    swap_ab: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) in x's dtype (fp16 or bf16) on tensor cores."""
    tiles = triton.cdiv(x.shape[0], block_m) * triton.cdiv(kw.out_features, block_n)
    x, out, split_k, ws, cnt = launch_buffers(x, kw, out, split_k, blocks, tiles)
    m, k = x.shape
    _GEMM((tiles, split_k), (  # every parameter of gemm_kernel, in order
        x, kw.qweight, kw.scales, kw.zeros, bias if bias is not None else out, out, ws, cnt,
        m, kw.out_features, k, kw.qweight.shape[1], kw.scales.shape[1], x.stride(0), out.stride(0),
        kw.group_size, kw.bits, block_m, block_n, blocks, split_k, split_k > 1, bias is not None, swap_ab,
    ), num_warps=num_warps, num_stages=num_stages)
    return out


_DEQUANT = KeptKernel(dequant_kernel)


def dequantize(kw: KernelWeights, dtype: torch.dtype, block_n: int = 32, blocks: int = 16) -> torch.Tensor:
    """W [N, K] in `dtype`, for the dequantize-then-cuBLAS path."""
    n, k = kw.out_features, kw.in_features
    k8, g = kw.qweight.shape[1], kw.scales.shape[1]
    out = torch.empty(n, k, dtype=dtype, device=kw.qweight.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k8, 4 * blocks))
    _DEQUANT(grid, (kw.qweight, kw.scales, kw.zeros, out, n, k, k8, g, kw.group_size, kw.bits, block_n, blocks),
             num_warps=4)
    return out
