"""Paged decode attention without `tl.dot`, for small query groups (heads per kv head ≤ 4; MHA above all).

Why: triton_paged.decode_kernel gives each kv head's query rows to `tl.dot`, which needs 16 rows, so
with one query row per kv head (Llama-2-7B, MHA) the tensor cores do 16× the real work and every int8/int4
code goes through a conversion into a dot operand. Here the products run on the CUDA cores in fp32, for
the real rows only: scores as q broadcast against the key tile and summed over channels, p·v as p
broadcast against the value tile and summed over tokens. For MHA over int8/int4 codes it measured faster
than the dot kernel, so it is the default there (triton_paged.decode_variant; the figures, and KV4's
decode taking fp16's time, are in bench/KERNELS_NOTES.md and BENCHMARKS.md).

What it computes is decode_kernel's (same pool layout, halves A and B, partitions merged by
triton_paged.merge_kernel, a grid independent of the context lengths), with the codes dequantized on
the way in at one float add per element: the fp32 bits 0x4B000000 | c are the number 2^23 + c (exact for
c < 2^23), so c − z = bits_as_float(0x4B000000 | c) − (2^23 + z) exactly, with no int→float conversion.
The token's scale then applies once per token: q·k = s·Σ q·(c − z); p·v = Σ (p·s)·(c − z).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_paged_common import decode_program, load_raw, pool_row, store_decode

# groups up to this size go to this kernel when `paged_decode_attention` is asked for "rows"
MAX_GROUP = 4
# Tokens per tile and warps: the fastest of 32–128 × 2–8 for Llama-2-7B at b1 and b32 × 4,096, all formats;
# fewer warps were faster in every case (bench/KERNELS_NOTES.md).
BLOCK_N = 128
NUM_WARPS = 2


@triton.jit
def _load_values(codes_ptr, scale_ptr, zero_ptr, row, nmask, offs_i, mask, HALF: tl.constexpr,
                 BITS: tl.constexpr):
    """Halves A and B [BLOCK_N, BLOCK_HALF] of K or V for cache rows `row` in fp32, and the tokens' scales
    [BLOCK_N]: stored values and scale 1 for fp16/bf16 blocks, codes minus zero for int8/int4 blocks."""
    a, b = load_raw(codes_ptr, row, offs_i, mask, HALF, BITS)
    if BITS == 16:
        return a.to(tl.float32), b.to(tl.float32), tl.full(nmask.shape, 1.0, tl.float32)
    else:
        scale = tl.load(scale_ptr + row, mask=nmask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + row, mask=nmask, other=0).to(tl.float32) + 8388608.0  # 2^23 + z
        a = (a.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - zero[:, None]
        b = (b.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - zero[:, None]
        return a, b, scale


@triton.jit
def _tile(acc_a, acc_b, m_i, l_i, q_a, q_b, n0, end, bt_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
          kvh, kv_heads, offs_i, imask, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
          BITS: tl.constexpr, ONE: tl.constexpr):
    """The online softmax advanced by keys n0 … n0 + BLOCK_N − 1 (those from `end` on are masked). q is
    scaled by sm_scale·log2(e) in fp32. ONE (a single query row): q [BLOCK_HALF], acc [BLOCK_HALF], m and
    l [1]; else q and acc [BLOCK_G, BLOCK_HALF], m and l [BLOCK_G], the products through a 3-D broadcast."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    off = offs_n % BLOCK_SIZE
    row = pool_row(block, off, kvh, kv_heads, BLOCK_SIZE)  # its codes, scale and zero
    mask = nmask[:, None] & imask[None, :]

    k_a, k_b, k_s = _load_values(kc_ptr, ks_ptr, kz_ptr, row, nmask, offs_i, mask, HALF, BITS)
    if ONE:
        s = tl.sum(q_a[None, :] * k_a + q_b[None, :] * k_b, axis=1) * k_s  # [BLOCK_N]
        s = tl.where(nmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
    else:
        s = tl.sum(q_a[:, None, :] * k_a[None, :, :] + q_b[:, None, :] * k_b[None, :, :], axis=2)
        s = s * k_s[None, :]  # [BLOCK_G, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

    v_a, v_b, v_s = _load_values(vc_ptr, vs_ptr, vz_ptr, row, nmask, offs_i, mask, HALF, BITS)
    if ONE:
        ps = (p * v_s)[:, None]
        acc_a = acc_a * alpha + tl.sum(ps * v_a, axis=0)
        acc_b = acc_b * alpha + tl.sum(ps * v_b, axis=0)
    else:
        ps = (p * v_s[None, :])[:, :, None]
        acc_a = acc_a * alpha[:, None] + tl.sum(ps * v_a[None, :, :], axis=1)
        acc_b = acc_b * alpha[:, None] + tl.sum(ps * v_b[None, :, :], axis=1)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def decode_rows_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, ctx_ptr,
                       out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, qk_scale, kv_heads, heads, partitions,
                       stride_qb, stride_qh, stride_bt,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr):
    """decode_kernel's parameters and results; one program per (sequence, kv head, partition)."""
    b, kvh, part, start, end, head, gmask, offs_i, imask, ca, cb, qmask = decode_program(
        ctx_ptr, partitions, GROUP, BLOCK_G, HALF, BLOCK_HALF, BLOCK_N, BITS)
    bt_row = bt_ptr + b * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if GROUP == 1:
        q_row = q_ptr + b * stride_qb + kvh * stride_qh
        q_a = tl.load(q_row + ca, mask=imask, other=0.0).to(tl.float32) * qk_scale
        q_b = tl.load(q_row + cb, mask=imask, other=0.0).to(tl.float32) * qk_scale
        acc_a = tl.zeros([BLOCK_HALF], tl.float32)
        acc_b = tl.zeros([BLOCK_HALF], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _tile(acc_a, acc_b, m_i, l_i, q_a, q_b, n0, end, bt_row, kc_ptr, vc_ptr,
                                           ks_ptr, kz_ptr, vs_ptr, vz_ptr, kvh, kv_heads, offs_i, imask, HALF,
                                           BLOCK_SIZE, BLOCK_N, BITS, True)
        acc_a, acc_b = acc_a[None, :], acc_b[None, :]
    else:
        q_row = q_ptr + b * stride_qb + head[:, None] * stride_qh
        q_a = tl.load(q_row + ca[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
        q_b = tl.load(q_row + cb[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
        acc_a = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
        acc_b = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            acc_a, acc_b, m_i, l_i = _tile(acc_a, acc_b, m_i, l_i, q_a, q_b, n0, end, bt_row, kc_ptr, vc_ptr,
                                           ks_ptr, kz_ptr, vs_ptr, vz_ptr, kvh, kv_heads, offs_i, imask, HALF,
                                           BLOCK_SIZE, BLOCK_N, BITS, False)

    store_decode(acc_a, acc_b, m_i, l_i, out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, b, head, part, heads,
                 partitions, ca, cb, qmask, gmask, HALF, SPLIT)


DECODE_ROWS = KeptKernel(decode_rows_kernel)
