"""Pieces shared by the paged KV kernels (triton_paged.py, triton_paged_rows.py, triton_prefill.py): how a
token's place in the pool and a head's two halves of channels are addressed, how a decode program finds
its share of a context and stores its result (see triton_paged's module docstring for the layout)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def halves(offs_i, HALF: tl.constexpr, BITS: tl.constexpr):
    """Channel indices of halves A and B in a head of 2 * HALF channels (triton_paged's docstring)."""
    if BITS == 4:
        return 2 * offs_i, 2 * offs_i + 1
    else:
        return offs_i, offs_i + HALF


@triton.jit
def pool_row(block, offset, kv_head, kv_heads, block_size):
    """Row of a token's codes in the pool, and element of its scale and zero: all are stored
    [block, kv head, token, ...] (paged_kv.PagedKV)."""
    return (block * kv_heads + kv_head) * block_size + offset


@triton.jit
def load_raw(codes_ptr, row, offs_i, mask, HALF: tl.constexpr, BITS: tl.constexpr):
    """Halves A and B [BLOCK_N, BLOCK_HALF] of K or V as stored (fp16 values, or int8/int4 codes as uint8)."""
    if BITS == 4:
        byte = tl.load(codes_ptr + row[:, None] * HALF + offs_i[None, :], mask=mask, other=0)
        return byte & 0x0F, byte >> 4
    else:
        base = codes_ptr + row[:, None] * (2 * HALF) + offs_i[None, :]
        return tl.load(base, mask=mask, other=0), tl.load(base + HALF, mask=mask, other=0)


@triton.jit
def partition_share(ctx_ptr, b, part, partitions, BLOCK_N: tl.constexpr):
    """[start, end) of sequence b's context that partition `part` attends to: whole tiles, spread evenly
    over the partitions at run time (the grid never depends on the context lengths)."""
    ctx = tl.load(ctx_ptr + b)
    tiles_per_part = tl.cdiv(tl.cdiv(ctx, BLOCK_N), partitions)
    start = part * tiles_per_part * BLOCK_N
    return start, tl.minimum(start + tiles_per_part * BLOCK_N, ctx)


@triton.jit
def decode_program(ctx_ptr, partitions, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    """Where a decode program (grid: sequence, kv head, partition) works: b, kv head, partition, its
    [start, end) share of the context, its query heads [BLOCK_G] and their mask, the channel lanes
    [BLOCK_HALF] and their mask, the channels of halves A and B, and the [BLOCK_G, BLOCK_HALF] q mask."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    start, end = partition_share(ctx_ptr, b, part, partitions, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < GROUP
    offs_i = tl.arange(0, BLOCK_HALF)
    imask = offs_i < HALF
    ca, cb = halves(offs_i, HALF, BITS)
    return b, kvh, part, start, end, kvh * GROUP + offs_g, gmask, offs_i, imask, ca, cb, gmask[:, None] & imask[None, :]


@triton.jit
def store_decode(acc_a, acc_b, m_i, l_i, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, b, head, part, heads,
                 partitions, ca, cb, qmask, gmask, HALF: tl.constexpr, SPLIT: tl.constexpr):
    """A decode program's result for its query heads [BLOCK_G]: normalised into `out` (the query's dtype),
    or with SPLIT as fp32 partials with their running max and sum, for merge_kernel."""
    # an empty share (or a padded batch row with no context) leaves l = 0: its output is 0, not NaN
    inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)[:, None]
    if SPLIT:
        at = ((b * heads + head) * partitions + part)
        dst = part_out_ptr + at[:, None] * (2 * HALF)
        tl.store(dst + ca[None, :], acc_a * inv, mask=qmask)
        tl.store(dst + cb[None, :], acc_b * inv, mask=qmask)
        tl.store(part_m_ptr + at, m_i, mask=gmask)
        tl.store(part_l_ptr + at, l_i, mask=gmask)
    else:
        dst = out_ptr + (b * heads + head[:, None]) * (2 * HALF)
        dtype = out_ptr.dtype.element_ty
        tl.store(dst + ca[None, :], (acc_a * inv).to(dtype), mask=qmask)
        tl.store(dst + cb[None, :], (acc_b * inv).to(dtype), mask=qmask)
