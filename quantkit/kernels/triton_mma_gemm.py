"""Tensor-core GEMM on the mma layout for M > 16: y = x · Wᵀ with W dequantized tile by tile in registers.

The GEMV of `triton_mma` keeps the whole B operand (x) of each K-tile in registers, which caps it at
64 rows of x and, at M = 32–64, at 8 warps per SM (255 registers). Here Triton's `tl.dot` does the
matrix work (wgmma on Hopper) and pipelines the loads; the kernel only turns the mma layout's words into
an fp16 tile. The product is computed transposed, Wᵀ-side first: yᵀ [BN, BM] = W [BN, 128] · xᵀ
[128, BM], so the dequantized weights are the A operand (which wgmma may take from registers) and x,
which several programs share, comes through shared memory.

No copy of the weights in another layout: a 16-row tile and a 128-input K-tile are one block of the mma
layout (`triton_mma` docstring) and its words are read in place. Within a K-tile the dot's inputs are
taken in the order the words hold them — column j = 8·w + o of the tile is value o of word w (W4) —
and x is loaded in that same order, which keeps x's loads in runs of 8 (W4) or 4 (W8) contiguous
inputs. A sum over K does not care about the order as long as both operands follow it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.triton_gemm import _dequant_values, _zero_bias_scale
from quantkit.kernels.triton_mma import TILE_K, MmaWeights


@triton.jit
def _word_offsets(n, BITS: tl.constexpr):
    """Word offsets in a (row tile, K-tile) block: (row part [BN], word part [WPR]) for rows n (any
    16-row tile) and the WPR words of a row, in the row's word order (module docstring of triton_mma:
    blocks are [row half, chunk v, lane 4·g + t, 4 words])."""
    WPR: tl.constexpr = 4 * BITS  # words per row and K-tile: 16 (W4), 32 (W8)
    w = tl.arange(0, WPR)
    r = n % 16
    row = (r // 8) * (8 * WPR) + (r % 8) * 16  # row half, then g's lane 4·g
    if BITS == 4:
        col = w  # word 4·t + c: lane's t, then its 4 words
    else:
        col = (w // 8) * 4 + ((w % 8) // 4) * 128 + w % 4  # word 8·t + 4·v + i
    return tl.multiple_of(row, 16), tl.max_contiguous(tl.multiple_of(col, 4), 4)


@triton.jit
def _input_offsets(BITS: tl.constexpr):
    """For each column j of a dequantized [BN, 128] tile, the input (0…127 within the K-tile) it holds:
    value j % (32/b) of the row's word j // (32/b) (W4 word 4·t + c holds inputs 32·c + 8·t + (0…7),
    W8 word 8·t + 2·c + h inputs 32·c + 8·t + 4·h + (0…3))."""
    j = tl.arange(0, 128)
    if BITS == 4:
        w = j // 8
        k = 32 * (w % 4) + 8 * (w // 4) + j % 8
    else:
        w = j // 4
        k = 32 * ((w % 8) // 2) + 8 * (w // 8) + 4 * (w % 2) + j % 4
    return tl.max_contiguous(tl.multiple_of(k, 32 // BITS), 32 // BITS)


@triton.jit
def _repeat_words(words, R: tl.constexpr, BITS: tl.constexpr):
    """[R, words] → [R, 128]: each word repeated 32/b times in a row (column j holds word j // (32/b)).
    Built by joins, which keep the words' own layout (rows across threads) and add registers; a
    broadcast over a third axis lets Triton pick a layout with every row in each thread."""
    v = tl.join(words, words)
    v = tl.join(v, v)
    if BITS == 4:
        v = tl.join(v, v)
    return tl.reshape(v, [R, 128])


@triton.jit
def mma_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, KW, G, stride_xm, stride_om,
                    group_size: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr):
    """yᵀ tile [BN rows of W, BM rows of x] per program; programs that share a W tile are adjacent."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BM)
    pid_n = pid // m_tiles
    pid_m = pid % m_tiles
    PER_WORD: tl.constexpr = 32 // BITS
    WPR: tl.constexpr = 128 // PER_WORD
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    n = pid_n * BN + tl.arange(0, BN)
    m = pid_m * BM + tl.arange(0, BM)
    n_ok = n < N
    nc = tl.minimum(n, N - 1)  # rows past N read row N − 1's words (no mask on the word loads)
    row, col = _word_offsets(nc, BITS)
    w_rows = w_ptr + (nc // 16).to(tl.int64)[:, None] * KW + row[:, None] + col[None, :]
    kin = _input_offsets(BITS)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    o = tl.arange(0, 128) % PER_WORD
    if BITS == 4:
        shift = ((o & 1) * 4 + ((o >> 1) & 1) * 2 + (o >> 2)) * 4  # W4_ORDER is its own inverse
    else:
        shift = o * 8
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    tiles = tl.cdiv(K, 128)
    for t in tl.range(0, tiles, num_stages=NUM_STAGES):
        words = tl.load(w_rows + t * (WPR * 16))
        gi = tl.minimum(t * 128 // group_size, G - 1)
        zb, s = _zero_bias_scale(tl.load(s_ptr + n * G + gi, mask=n_ok, other=0.0),
                                 tl.load(z_ptr + n * G + gi, mask=n_ok, other=0).to(tl.int32), HALF)
        q = (_repeat_words(words, BN, BITS) >> shift[None, :]) & ((1 << BITS) - 1)
        w = _dequant_values(q, zb[:, None], s[:, None], HALF, dtype)
        k = t * 128 + kin
        xs = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(xs, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(ptrs, acc.to(dtype), mask=(m < M)[:, None] & n_ok[None, :])


def gemm(
    x: torch.Tensor,
    mw: MmaWeights,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 64,
    block_m: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) on the tensor cores from the mma layout (x fp16, or bf16 with W4).

    A program computes `block_n` output columns × `block_m` rows of x (powers of two, ≥ 16) with
    `num_warps` warps; `num_stages` K-tiles are in flight (Triton's software pipeline)."""
    m, k = x.shape
    if k != mw.in_features:
        raise ValueError(f"x has {k} inputs, the layer {mw.in_features}")
    if mw.scales.shape[1] > 1 and mw.group_size % TILE_K:
        raise ValueError(f"the mma layout needs groups of whole {TILE_K}-input tiles, got group size {mw.group_size}")
    n = mw.out_features
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)
    mma_gemm_kernel[grid](
        x, mw.qweight, mw.scales, mw.zeros, bias if bias is not None else out, out, m, n, k,
        mw.qweight.shape[1], mw.scales.shape[1], x.stride(0), out.stride(0), group_size=mw.group_size,
        BITS=mw.bits, BN=block_n, BM=block_m, HAS_BIAS=bias is not None, NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    return out
