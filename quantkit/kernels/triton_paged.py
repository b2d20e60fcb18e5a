"""Triton kernels of the paged KV cache (kernels/paged_kv.py): the write, and decode attention.

The write codes each token with its own range, or with the cache's static per-head scale and zero
(STATIC), and stores the scale and zero per token either way, so decode attention reads one layout.

Both see a head's channels as two halves, A and B: for fp16 and int8 blocks the first and the second
half of head_dim, for int4 the even and the odd channels (the low and the high nibble of one byte).
So an int4 block is read with one byte load per channel pair and never needs an interleave: q·k is
q_A·k_A + q_B·k_B, and p·v fills the output's A and B channels separately.

Decode attention (flash-decoding): one program per (sequence, kv head, partition). The program holds
the query heads that share its kv head (GQA; padded to 16 rows for tl.dot) and walks its share of the
context in tiles of BLOCK_N tokens, looking up each token's block in the block table, with an online
softmax. int8/int4 codes enter the dot products as they are (small integers, exact in fp16/bf16; in
fp16 offset by 1024, see `_load_codes`); each token's scale and zero apply once per token outside them:
q·k = s·(q·c − z·Σq), p·v = (p·s)·c − Σ(p·s)·z. A sequence's context is split evenly over the
launch's partitions at run time, so the grid depends only on the batch size and the cache, never on
the context lengths: the launch is the same in every replay of a CUDA graph. With more than one
partition a second small kernel merges the partial results (each kept with its running max and sum).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from quantkit.kernels import triton_paged_rows as rows
from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_paged_common import decode_program, halves, load_raw, pool_row, store_decode

LOG2E = 1.4426950408889634
MIN_SCALE = 2.0**-14
MAX_PARTITIONS = 64


@triton.jit
def _round_half_even(y):
    """torch.round: to nearest, ties to even (libdevice.rint has no interpreter implementation)."""
    # floor(y + 0.5) would round y = 0.5 - 2^-25 up (the sum rounds to 1.0); y - floor(y) is exact.
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _write_one(x_ptr, stride_t, stride_h, t, slot, codes_ptr, scale_ptr, zero_ptr, fixed_scale_ptr, fixed_zero_ptr,
               kv_heads, block_size, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BITS: tl.constexpr, STATIC: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    hmask = offs_h < kv_heads
    mask = hmask[:, None] & (offs_i < HALF)[None, :]
    ca, cb = halves(offs_i, HALF, BITS)
    src = x_ptr + t * stride_t + offs_h[:, None] * stride_h
    xa = tl.load(src + ca[None, :], mask=mask, other=0.0)
    xb = tl.load(src + cb[None, :], mask=mask, other=0.0)
    # the token's row in the pool for every head, and its scale and zero element: [block, head, token, ...]
    row = pool_row(slot // block_size, slot % block_size, offs_h, kv_heads, block_size)
    if BITS == 16:
        dst = codes_ptr + row[:, None] * (2 * HALF)
        tl.store(dst + ca[None, :], xa.to(codes_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + cb[None, :], xb.to(codes_ptr.dtype.element_ty), mask=mask)
    else:
        qmax: tl.constexpr = 255.0 if BITS == 8 else 15.0
        xa, xb = xa.to(tl.float32), xb.to(tl.float32)
        if STATIC:  # the head's calibrated scale and zero (paged_kv.static_scales)
            scale = tl.load(fixed_scale_ptr + offs_h, mask=hmask, other=1.0).to(tl.float32)
            zero = tl.load(fixed_zero_ptr + offs_h, mask=hmask, other=0).to(tl.float32)
        else:
            # padding lanes hold 0, which the range includes anyway
            lo = tl.minimum(tl.minimum(tl.min(xa, axis=1), tl.min(xb, axis=1)), 0.0)
            hi = tl.maximum(tl.maximum(tl.max(xa, axis=1), tl.max(xb, axis=1)), 0.0)
            scale = tl.maximum(tl.math.div_rn(hi - lo, qmax), 2.0**-14)
            scale = (scale * (1.0 + 2.0**-10)).to(tl.float16).to(tl.float32)  # rounded up: see paged_kv
            zero = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(-lo, scale)), 0.0), qmax)
        qa = _round_half_even(tl.math.div_rn(xa, scale[:, None])) + zero[:, None]
        qb = _round_half_even(tl.math.div_rn(xb, scale[:, None])) + zero[:, None]
        qa = tl.minimum(tl.maximum(qa, 0.0), qmax).to(tl.uint8)
        qb = tl.minimum(tl.maximum(qb, 0.0), qmax).to(tl.uint8)
        if BITS == 4:
            tl.store(codes_ptr + row[:, None] * HALF + offs_i[None, :], qa | (qb << 4), mask=mask)
        else:
            dst = codes_ptr + row[:, None] * (2 * HALF)
            tl.store(dst + ca[None, :], qa, mask=mask)
            tl.store(dst + cb[None, :], qb, mask=mask)
        tl.store(scale_ptr + row, scale.to(tl.float16), mask=hmask)
        tl.store(zero_ptr + row, zero.to(tl.uint8), mask=hmask)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                    fks_ptr, fkz_ptr, fvs_ptr, fvz_ptr, kv_heads, block_size, stride_kt, stride_kh, stride_vt, stride_vh,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BITS: tl.constexpr,
                    STATIC: tl.constexpr):
    """One program per token; f*_ptr are the static per-head scales and zeros (read when STATIC)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _write_one(k_ptr, stride_kt, stride_kh, t, slot, kc_ptr, ks_ptr, kz_ptr, fks_ptr, fkz_ptr, kv_heads,
                   block_size, HALF, BLOCK_H, BLOCK_HALF, BITS, STATIC)
        _write_one(v_ptr, stride_vt, stride_vh, t, slot, vc_ptr, vs_ptr, vz_ptr, fvs_ptr, fvz_ptr, kv_heads,
                   block_size, HALF, BLOCK_H, BLOCK_HALF, BITS, STATIC)


# Launched through KeptKernel (launch.py): after the first launch with a signature, the compiled kernel is
# called directly, without Triton's front end (tens of µs of host time per launch), which matters in
# the engine's eager (prefill) steps.
_WRITE = KeptKernel(write_kv_kernel)


def scale_args(cache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' (k_scale, k_zero, v_scale, v_zero) arguments: the cache's, or for a 16-bit cache (which
    has none and whose kernels never read them) its K and V again, as placeholders."""
    if cache.bits == 16:
        return cache.k, cache.k, cache.v, cache.v
    return cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero


def write_kv(cache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Triton form of paged_kv.write_kv (same arguments)."""
    t, kv_heads, d = k.shape
    if t == 0:
        return
    if d % 2:
        raise ValueError(f"the KV write kernel needs an even head_dim, not {d}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv needs k and v contiguous in their last dim")
    bits = cache.bits
    ks, kz, vs, vz = scale_args(cache)
    static = getattr(cache, "static", None)
    fixed = static if static is not None else (ks, kz, vs, vz)  # not read without STATIC
    _WRITE((t,), (k, v, slot_mapping, cache.k, cache.v, ks, kz, vs, vz, *fixed, kv_heads,  # every parameter, in order
                  cache.block_size, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  d // 2, triton.next_power_of_2(kv_heads), triton.next_power_of_2(d // 2), bits,
                  static is not None), num_warps=4)


@triton.jit
def _code_offset(out_dtype: tl.constexpr):
    """What `_load_codes` adds to every code: 1024 for fp16, 0 otherwise. Readers add it to the zero point."""
    if out_dtype == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def _load_codes(codes_ptr, row, offs_i, mask, out_dtype: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr):
    """Halves A and B of int8/int4 codes for cache rows `row`, as `out_dtype` values c + `_code_offset`, not
    dequantized. For fp16 without a conversion instruction: the bits 0x6400 | c are the fp16 number 1024 + c
    (exact for c < 1024), so an integer OR makes the value and the offset folds into the zero point, where
    the conversion unit (a quarter of the integer rate) would otherwise run once per cached element."""
    a, b = load_raw(codes_ptr, row, offs_i, mask, HALF, BITS)
    if out_dtype == tl.float16:
        a = (a.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        b = (b.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        return a, b
    else:  # through fp32: the interpreter turns uint8 straight into bfloat16 wrongly (the GPU takes either)
        return a.to(tl.float32).to(out_dtype), b.to(tl.float32).to(out_dtype)


@triton.jit
def attend_tile(acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, pos, n0, kv_end, bt_row, kc_ptr, vc_ptr, ks_ptr,
                kz_ptr, vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, CAUSAL: tl.constexpr):
    """One step of the online softmax, shared by decode and prefill attention: (acc_a, acc_b, m, l)
    advanced by keys n0 … n0 + BLOCK_N − 1 of the sequence whose block-table row is `bt_row`. Keys from
    kv_end on are never loaded (their table entries may be garbage); with CAUSAL, row r sees keys up to
    pos[r] (< kv_end), without it the caller knows every key of the tile is below kv_end."""
    dtype = q_a.dtype
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < kv_end
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    off = offs_n % BLOCK_SIZE
    row = pool_row(block, off, kvh, kv_heads, BLOCK_SIZE)  # its codes, scale and zero
    mask = nmask[:, None] & imask[None, :]
    if BITS == 16:
        k_a, k_b = load_raw(kc_ptr, row, offs_i, mask, HALF, BITS)  # the cache's dtype is q's
        s = tl.dot(q_a, tl.trans(k_a)) + tl.dot(q_b, tl.trans(k_b))
    else:
        # Quantized K, dequantized outside the tile: q·((c − z)·s) = s·(q·c − z·Σq). The codes go into
        # the dot as they are (small integers, exact in fp16), so the tile needs no arithmetic per
        # element; the scale and zero apply once per token.
        k_a, k_b = _load_codes(kc_ptr, row, offs_i, mask, dtype, HALF, BITS)
        k_s = tl.load(ks_ptr + row, mask=nmask, other=0.0).to(tl.float32)
        k_z = tl.load(kz_ptr + row, mask=nmask, other=0).to(tl.float32) + _code_offset(dtype)
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
        v_a, v_b = load_raw(vc_ptr, row, offs_i, mask, HALF, BITS)
        p16 = p.to(dtype)
        acc_a = acc_a * alpha[:, None] + tl.dot(p16, v_a)
        acc_b = acc_b * alpha[:, None] + tl.dot(p16, v_b)
    else:
        # Σ_n p_n·s_n·(c_n − z_n) = (p·s)·c − Σ_n (p·s)_n·z_n: the scales go into p, the zeros into one
        # correction per query row, taken from the same rounded p·s that meets the codes.
        v_a, v_b = _load_codes(vc_ptr, row, offs_i, mask, dtype, HALF, BITS)
        v_s = tl.load(vs_ptr + row, mask=nmask, other=0.0).to(tl.float32)
        v_z = tl.load(vz_ptr + row, mask=nmask, other=0).to(tl.float32) + _code_offset(dtype)
        ps = (p * v_s[None, :]).to(dtype)
        corr = tl.sum(ps.to(tl.float32) * v_z[None, :], axis=1)[:, None]
        acc_a = acc_a * alpha[:, None] + (tl.dot(ps, v_a) - corr)
        acc_b = acc_b * alpha[:, None] + (tl.dot(ps, v_b) - corr)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, ctx_ptr,
                  out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, qk_scale, kv_heads, heads, partitions,
                  stride_qb, stride_qh, stride_bt,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr):
    b, kvh, part, start, end, head, gmask, offs_i, imask, ca, cb, qmask = decode_program(
        ctx_ptr, partitions, GROUP, BLOCK_G, HALF, BLOCK_HALF, BLOCK_N, BITS)
    q_row = q_ptr + b * stride_qb + head[:, None] * stride_qh
    q_a = tl.load(q_row + ca[None, :], mask=qmask, other=0.0)
    q_b = tl.load(q_row + cb[None, :], mask=qmask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_a = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
    # Σ_channels q, for the zero points folded out of q·k (quantized K, below); computed for every format, as
    # a value defined under a constexpr branch only cannot enter the loop's carried values.
    q_sum = tl.sum(q_a.to(tl.float32), axis=1) + tl.sum(q_b.to(tl.float32), axis=1)
    bt_row = bt_ptr + b * stride_bt
    last = tl.zeros([BLOCK_G], tl.int32) + end - 1  # every query head sees the whole share
    for n0 in range(start, end, BLOCK_N):
        acc_a, acc_b, m_i, l_i = attend_tile(
            acc_a, acc_b, m_i, l_i, q_a, q_b, q_sum, last, n0, end, bt_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr,
            vs_ptr, vz_ptr, kvh, kv_heads, qk_scale, offs_i, imask, HALF, BLOCK_SIZE, BLOCK_N, BITS, True)

    store_decode(acc_a, acc_b, m_i, l_i, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, b, head, part, heads,
                 partitions, ca, cb, qmask, gmask, HALF, SPLIT)


@triton.jit
def merge_kernel(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, partitions, D: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = Σ_p w_p o_p / Σ_p w_p with w_p = l_p · 2^(m_p − max m): the partitions' softmax merged."""
    bh = tl.program_id(0).to(tl.int64)  # b * heads + head
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < partitions
    m = tl.load(part_m_ptr + bh * partitions + offs_p, mask=pmask, other=float("-inf"))
    l = tl.load(part_l_ptr + bh * partitions + offs_p, mask=pmask, other=0.0)
    m_max = tl.max(tl.where(l > 0, m, -1e30), axis=0)
    w = tl.where(l > 0, l * tl.exp2(m - m_max), 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    o = tl.load(part_out_ptr + (bh * partitions + offs_p[:, None]) * D + offs_d[None, :],
                mask=pmask[:, None] & (offs_d < D)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + bh * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


_DECODE = KeptKernel(decode_kernel)
_MERGE = KeptKernel(merge_kernel)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on the CPU: a few partitions, so that CI runs the split path


def num_partitions(batch: int, kv_heads: int, max_tokens: int, device: torch.device, block_n: int) -> int:
    """Partitions per (sequence, kv head): enough for about 4 programs per SM, at most one per tile of
    the longest context the block table can hold, and at most 64. Depends on no context length."""
    want = math.ceil(4 * _sm_count(device) / (batch * kv_heads))
    return max(1, min(want, math.ceil(max_tokens / block_n), MAX_PARTITIONS))


def decode_variant(group: int, bits: int, kernel: str | None = None, preferred: str = "auto") -> str:
    """Which decode kernel runs: "dot" (decode_kernel) or "rows" (triton_paged_rows: no tl.dot, for
    query groups of at most MAX_GROUP rows). `kernel` asks for one outright; else `preferred` (the pool's
    KernelSettings.decode: "rows" there applies only where the group is small enough), and "auto" is the
    measured rule — "rows" for MHA (one query row per kv head) over int8/int4 codes, "dot" otherwise (at
    GQA 4 the rows kernel measured several times slower: bench/KERNELS_NOTES.md)."""
    if kernel is None:
        kernel = preferred
        if kernel == "auto":
            kernel = "rows" if group == 1 and bits != 16 else "dot"
        elif kernel == "rows" and group > rows.MAX_GROUP:
            kernel = "dot"
    if kernel not in ("dot", "rows"):
        raise ValueError(f"unknown decode kernel {kernel!r}: choose 'dot' or 'rows'")
    if kernel == "rows" and group > rows.MAX_GROUP:
        raise ValueError(f"the 'rows' decode kernel takes at most {rows.MAX_GROUP} query heads per kv head, "
                         f"not {group}")
    return kernel


def paged_decode_attention(q: Tensor, cache, block_tables: Tensor, context_lens: Tensor, sm_scale: float,
                           partitions: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                           kernel: str | None = None, maxnreg: int | None = None) -> Tensor:
    """Triton form of paged_kv.paged_decode_attention; `partitions` overrides `num_partitions`, and
    `block_n` (tokens per tile) and `num_warps` the variant's tile settings (dot: 64 and 4, rows:
    triton_paged_rows.BLOCK_N and NUM_WARPS);
    `kernel` picks the variant (`decode_variant`); `maxnreg` caps the registers per thread (more programs
    resident per SM: the occupancy probe bench/probes/kv4_occupancy.py)."""
    batch, heads, d = q.shape
    if d % 2:
        raise ValueError(f"the paged decode kernel needs an even head_dim, not {d}")
    kv_heads = cache.kv_heads
    group = heads // kv_heads
    kernel = decode_variant(group, cache.bits, kernel, cache.kernels.decode)
    if kernel == "rows":
        block_n, num_warps = block_n or rows.BLOCK_N, num_warps or rows.NUM_WARPS
    block_n, num_warps = block_n or 64, num_warps or 4
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(batch, heads, d, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if partitions is None:
        max_tokens = block_tables.shape[1] * cache.block_size
        partitions = num_partitions(batch, kv_heads, max_tokens, q.device, block_n)
    split = partitions > 1
    if split:
        part_out = torch.empty(batch, heads, partitions, d, dtype=torch.float32, device=q.device)
        part_m = torch.empty(batch, heads, partitions, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # not read or written
    bits = cache.bits
    ks, kz, vs, vz = scale_args(cache)
    if kernel == "rows":  # same parameters; the group padded to a power of 2 only, not to 16 rows
        launch = rows.DECODE_ROWS
        block_g, block_half = triton.next_power_of_2(group), triton.next_power_of_2(d // 2)
    else:
        launch = _DECODE
        block_g, block_half = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d // 2))
    launch((batch, kv_heads, partitions), (  # every parameter of decode_kernel, in order
        q, cache.k, cache.v, ks, kz, vs, vz, block_tables, context_lens, out, part_out, part_m, part_l,
        sm_scale * LOG2E, kv_heads, heads, partitions, q.stride(0), q.stride(1), block_tables.stride(0),
        group, block_g, d // 2, block_half, cache.block_size, block_n, bits, split), num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    if split:
        # BLOCK_P fixed at the most partitions there are (64): one compiled merge for every batch size, so an
        # eager step with a new number of decodes compiles nothing
        _MERGE((batch * heads,), (part_out, part_m, part_l, out, partitions, d, MAX_PARTITIONS,
                                  triton.next_power_of_2(d)), num_warps=4)
    return out
