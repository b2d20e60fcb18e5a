"""Tensor-core GEMM for large M that reads the AWQ gemm checkpoint tensors as they are.

AWQ packs eight output columns per int32 along N (qweight [K, N/8], nibble order 0 2 4 6 1 3 5 7),
so a [BLOCK_K, BLOCK_N/8] tile of words unpacks along N into the [BLOCK_K, BLOCK_N] operand Wᵀ that
`tl.dot` wants: x and the packed words are both plain row-major tiles, which Triton streams through
shared memory (cp.async stages) with no permutation on either side. A tile of BLOCK_K inputs lies in
one quantization group (the launcher keeps BLOCK_K a divisor of the group size), so each tile needs one
row of scales and zeros. W = (q − z) · s is rounded to the activation dtype once, like the reference.
No repacking: at large M this path reads the checkpoint buffers the layer already holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_om, group_size: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the column tiles together, so a weight tile is read from DRAM about once.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    BN8: tl.constexpr = BLOCK_N // 8
    N8 = N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * BN8 + tl.arange(0, BN8)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok, w_ok = offs_m < M, offs_n < N, offs_w < N8
    t = tl.arange(0, 8)
    shifts = ((t // 2) + (t % 2) * 4) * 4  # column t of a word sits in nibble (t // 2) + 4 (t % 2)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        qw = tl.load(qw_ptr + kk.to(tl.int64)[:, None] * N8 + offs_w[None, :], mask=(kk < K)[:, None] & w_ok[None, :], other=0)
        g = k0 // group_size
        qz = tl.load(qz_ptr + g * N8 + offs_w, mask=w_ok, other=0)
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        q = (qw[:, :, None] >> shifts[None, None, :]) & 0xF
        z = (qz[:, None] >> shifts[None, :]) & 0xF
        if HALF:  # (q | 0x6400) read as fp16 is 1024 + q: q − z exact in fp16, one rounding by the scale
            qf = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            zf = (z | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            w = tl.reshape(qf - zf[None, :, :], [BLOCK_K, BLOCK_N]) * s[None, :]
        else:
            w = tl.reshape((q - z[None, :, :]).to(tl.float32), [BLOCK_K, BLOCK_N])
            w = (w * s.to(tl.float32)[None, :]).to(dtype)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)[None, :].to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(dtype),
             mask=m_ok[:, None] & n_ok[None, :])


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
    group_m: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] · Wᵀ (+ bias) for AWQ gemm tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N])."""
    m, k = x.shape
    n = scales.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    block_k = min(block_k, group_size)
    while group_size % block_k:
        block_k //= 2
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else out, out,
        m, n, k, x.stride(0), out.stride(0), group_size=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
