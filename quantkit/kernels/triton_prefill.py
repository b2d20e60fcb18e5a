"""Triton kernel of paged prefill attention: several sequences' new tokens, causal, over the paged KV cache.

Same semantics as paged_kv.paged_prefill_attention: q [T, heads, D] packed by query_start [B+1];
sequence b's n_b queries are the last n_b of its context_lens[b] cached tokens, so query i sits at
position L_b − n_b + i and attends keys 0 … L_b − n_b + i (bottom-right causal; with n_b = L_b plain
causal). One launch covers every sequence, whole prompts and cached prefixes alike.

Design (FlashAttention-2 over the paged cache): one program per (query tile, kv head, sequence). A
program's BLOCK_M rows are ROWS = BLOCK_M // GROUP consecutive queries times the GROUP query heads that
share its kv head (row m: query m // GROUP, head m % GROUP), so each K/V tile is loaded and converted
once for the whole group, and a sequence with few new tokens still fills the tile's rows. The program
walks its keys in tiles of BLOCK_N tokens, looking up each token's block in the block table, with an
online softmax in fp32 (exp2). Keys every row of the tile may see (up to its first query's position)
take a loop without a causal mask; the few tiles across the diagonal, up to its last query's position,
take a second loop with it. No key past a sequence's context is loaded, nor any table entry past it.

K/V are read as in the decode kernel (kernels/triton_paged.py, whose `attend_tile` this module runs):
two halves A and B of head_dim (the first and second half, or for int4 the even and odd channels),
and int8/int4 codes enter the dot products as they are, the scale and zero applied once per token:
q·k = s·(q·c − z·Σq) and p·v = (p·s)·c − Σ(p·s)·z. A token's codes are row
(block · kv_heads + head) · block_size + offset (`triton_paged_common.pool_row`) of the [num_blocks, kv_heads, block_size, ·]
pool, and its scale and zero the same element of their [num_blocks, kv_heads, block_size] tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_paged import LOG2E, attend_tile, scale_args
from quantkit.kernels.triton_paged_common import halves


@triton.jit
def prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, ctx_ptr, qstart_ptr, out_ptr,
                   qk_scale, kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_begin = tl.load(qstart_ptr + b)
    n = tl.load(qstart_ptr + b + 1) - q_begin
    q0 = tile * ROWS
    if q0 >= n:  # this sequence has fewer queries than the launch's longest (none at all when n = 0)
        return
    ctx = tl.load(ctx_ptr + b)
    q_end = tl.minimum(q0 + ROWS, n)  # one past this tile's last query

    offs_m = tl.arange(0, BLOCK_M)
    qi = q0 + offs_m // GROUP
    # padding rows (past the tile's queries) are neither loaded nor stored; their scores stay finite, as
    # every row sees key 0
    rmask = (offs_m < ROWS * GROUP) & (qi < q_end)
    head = kvh * GROUP + offs_m % GROUP
    pos = ctx - n + qi  # the query's position in its sequence: it sees keys 0 … pos

    offs_i = tl.arange(0, BLOCK_HALF)
    imask = offs_i < HALF
    ca, cb = halves(offs_i, HALF, BITS)
    qmask = rmask[:, None] & imask[None, :]
    q_row = q_ptr + (q_begin + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_a = tl.load(q_row + ca[None, :], mask=qmask, other=0.0)
    q_b = tl.load(q_row + cb[None, :], mask=qmask, other=0.0)
    q_sum = tl.sum(q_a.to(tl.float32), axis=1) + tl.sum(q_b.to(tl.float32), axis=1)  # used by int8/int4 K

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    # whole tiles of keys that every row sees (up to the first query's position), then the diagonal;
    # key 0 is in the first tile either way, so every row's running max is finite after it
    unmasked_end = (ctx - n + q0 + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx - n + q_end
    for n0 in range(0, unmasked_end, BLOCK_N):
        acc_a, acc_b, m_i, l_i = attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, pos, n0, kv_end, bt_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr,
            vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF, BLOCK_SIZE, BLOCK_N, BITS, False)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        acc_a, acc_b, m_i, l_i = attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, pos, n0, kv_end, bt_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr,
            vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF, BLOCK_SIZE, BLOCK_N, BITS, True)

    inv = (1.0 / l_i)[:, None]
    dst = out_ptr + (q_begin + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + ca[None, :], (acc_a * inv).to(dtype), mask=qmask)
    tl.store(dst + cb[None, :], (acc_b * inv).to(dtype), mask=qmask)


_PREFILL = KeptKernel(prefill_kernel)


def paged_prefill_attention(q: Tensor, cache, block_tables: Tensor, context_lens: Tensor, query_start: Tensor,
                            sm_scale: float, block_m: int = 64, block_n: int = 64, num_warps: int | None = None,
                            num_stages: int = 2, host=None) -> Tensor:
    """Triton form of paged_kv.paged_prefill_attention (same arguments, `host` included; context_lens and
    query_start int32). Sequences with no queries are skipped. `block_m` (rows per program: queries × the
    query heads of one kv head), `block_n` (keys per tile), `num_warps` and `num_stages` are the kernel's tile settings,
    chosen for head_dim 64/128 on Hopper and not measured on a GPU yet. num_warps None: 4, or 8 for
    int8/int4 codes at head_dim above 64, where 4 warps spill registers (ptxas for sm_90: 255 registers
    and 8–40 bytes of stack per thread; 8 warps take about as many registers and spill nothing)."""
    t, heads, d = q.shape
    if d % 2:
        raise ValueError(f"the paged prefill kernel needs an even head_dim, not {d}")
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    batch = block_tables.shape[0]
    if t == 0 or batch == 0:
        return out
    starts = host[0] if host is not None else query_start.tolist()
    max_n = max(e - s for s, e in zip(starts[:-1], starts[1:]))
    if max_n == 0:
        return out
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    rows = block_m // group
    bits = cache.bits
    ks, kz, vs, vz = scale_args(cache)
    if num_warps is None:
        num_warps = 8 if bits != 16 and d > 64 else 4
    grid = (triton.cdiv(max_n, rows), kv_heads, batch)
    _PREFILL(grid, (  # every parameter of prefill_kernel, in order
        q, cache.k, cache.v, ks, kz, vs, vz, block_tables, context_lens, query_start, out,
        sm_scale * LOG2E, kv_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        group, rows, block_m, d // 2, max(16, triton.next_power_of_2(d // 2)), cache.block_size, block_n, bits),
        num_warps=num_warps, num_stages=num_stages)
    return out
