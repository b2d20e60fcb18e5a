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

K/V are read as in the decode kernel (kernels/triton_paged.py, whose load helpers this module uses):
two halves A and B of head_dim (the first and second half, or for int4 the even and odd channels),
and int8/int4 codes enter the dot products as they are, the scale and zero applied once per token:
q·k = s·(q·c − z·Σq) and p·v = (p·s)·c − Σ(p·s)·z. A token's codes are row
(block · block_size + offset) · kv_heads + head, its scale and zero element `_scale_index` of their
[num_blocks, kv_heads, block_size] tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_paged import LOG2E, _code_offset, _halves, _load_codes, _load_raw, _scale_index


@triton.jit
def _attend_tile(acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, pos, n0, kv_end, bt_row, kc_ptr, vc_ptr, ks_ptr,
                 kz_ptr, vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, CAUSAL: tl.constexpr):
    """The online softmax advanced by keys n0 … n0 + BLOCK_N − 1 (those below kv_end); row r sees keys up
    to pos[r] (with CAUSAL; without it every key of the tile is one all rows see)."""
    dtype = q_a.dtype
    offs_n = n0 + tl.arange(0, BLOCK_N)
    # keys from kv_end on (past the last row's position) are masked by CAUSAL, and their table entries
    # may be garbage: never loaded
    nmask = offs_n < kv_end
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    off = offs_n % BLOCK_SIZE
    row = (block * BLOCK_SIZE + off) * kv_heads + kvh
    at = _scale_index(block, off, kvh, kv_heads, BLOCK_SIZE)
    mask = nmask[:, None] & imask[None, :]
    if BITS == 16:
        k_a, k_b = _load_raw(kc_ptr, row, offs_i, mask, HALF, BITS)
        s = tl.dot(q_a, tl.trans(k_a)) + tl.dot(q_b, tl.trans(k_b))
    else:
        k_a, k_b = _load_codes(kc_ptr, row, offs_i, mask, dtype, HALF, BITS)
        k_s = tl.load(ks_ptr + at, mask=nmask, other=0.0).to(tl.float32)
        k_z = tl.load(kz_ptr + at, mask=nmask, other=0).to(tl.float32) + _code_offset(dtype)
        s = tl.dot(q_a, tl.trans(k_a)) + tl.dot(q_b, tl.trans(k_b))
        s = (s - q_sum[:, None] * k_z[None, :]) * k_s[None, :]
    s = s * qk_scale
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if BITS == 16:
        v_a, v_b = _load_raw(vc_ptr, row, offs_i, mask, HALF, BITS)
        p16 = p.to(dtype)
        acc_a = acc_a * alpha[:, None] + tl.dot(p16, v_a)
        acc_b = acc_b * alpha[:, None] + tl.dot(p16, v_b)
    else:
        v_a, v_b = _load_codes(vc_ptr, row, offs_i, mask, dtype, HALF, BITS)
        v_s = tl.load(vs_ptr + at, mask=nmask, other=0.0).to(tl.float32)
        v_z = tl.load(vz_ptr + at, mask=nmask, other=0).to(tl.float32) + _code_offset(dtype)
        ps = (p * v_s[None, :]).to(dtype)
        corr = tl.sum(ps.to(tl.float32) * v_z[None, :], axis=1)[:, None]
        acc_a = acc_a * alpha[:, None] + (tl.dot(ps, v_a) - corr)
        acc_b = acc_b * alpha[:, None] + (tl.dot(ps, v_b) - corr)
    return acc_a, acc_b, m_new, l_i


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
    ca, cb = _halves(offs_i, HALF, BITS)
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
        acc_a, acc_b, m_i, l_i = _attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, pos, n0, kv_end, bt_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr,
            vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF, BLOCK_SIZE, BLOCK_N, BITS, False)
    for n0 in range(unmasked_end, kv_end, BLOCK_N):
        acc_a, acc_b, m_i, l_i = _attend_tile(
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
                            num_stages: int = 2) -> Tensor:
    """Triton form of paged_kv.paged_prefill_attention (same arguments; context_lens and query_start int32).
    Sequences with no queries are skipped. `block_m` (rows per program: queries × the query heads of one
    kv head), `block_n` (keys per tile), `num_warps` and `num_stages` are the kernel's tile settings,
    chosen for head_dim 64/128 on Hopper and not measured on a GPU yet. num_warps None: 4, or 8 for
    int8/int4 codes at head_dim above 64, where 4 warps spill registers (ptxas for sm_90: 255 registers
    and 8–40 bytes of stack per thread; 8 warps take about as many registers and spill nothing)."""
    from quantkit.kernels.paged_kv import _host_lists  # paged_kv dispatches here: imported at the call

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
    starts, _ = _host_lists(query_start, context_lens)
    max_n = max(e - s for s, e in zip(starts[:-1], starts[1:]))
    if max_n == 0:
        return out
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    rows = block_m // group
    bits = cache.bits
    ks, kz, vs, vz = (cache.k, cache.k, cache.v, cache.v) if bits == 16 else (  # not read for bits 16
        cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero)
    if num_warps is None:
        num_warps = 8 if bits != 16 and d > 64 else 4
    grid = (triton.cdiv(max_n, rows), kv_heads, batch)
    _PREFILL(grid, (  # every parameter of prefill_kernel, in order
        q, cache.k, cache.v, ks, kz, vs, vz, block_tables, context_lens, query_start, out,
        sm_scale * LOG2E, kv_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        group, rows, block_m, d // 2, max(16, triton.next_power_of_2(d // 2)), cache.block_size, block_n, bits),
        num_warps=num_warps, num_stages=num_stages)
    return out
