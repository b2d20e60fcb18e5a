"""Triton kernels of kernels/fused.py: RMSNorm (+ residual add), RoPE in place, SiLU·mul.

One program per token (row); the roundings are those of the torch reference in fused.py. Launched
through KeptKernel (launch.py), which skips Triton's front end after the first launch of a signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_fp8 import row_scale, to_e4m3
from quantkit.packing import E4M3_MAX, FP8_MIN_SCALE


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, s_ptr, static_ptr, n, stride_x, stride_r, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, QUANT: tl.constexpr,
                    STATIC: tl.constexpr, MIN_SCALE: tl.constexpr, FP8_MAX: tl.constexpr):
    """QUANT: the output (in OUT_DTYPE) quantized to e4m3 as triton_fp8.quantize_kernel does, its scale at
    s_ptr (per token) or static_ptr (STATIC)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(OUT_DTYPE)
        tl.store(h_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(OUT_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(OUT_DTYPE)
    if QUANT:
        yf = y.to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = row_scale(tl.max(tl.abs(yf), axis=0), MIN_SCALE, FP8_MAX)
            tl.store(s_ptr + row, scale)
        tl.store(out_ptr + row * n + cols, to_e4m3(yf, scale, FP8_MAX), mask=mask)
    else:
        tl.store(out_ptr + row * n + cols, y, mask=mask)


_RMS_NORM = KeptKernel(rms_norm_kernel)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, quantize: bool = False,
             input_scale: Tensor | None = None):
    """See fused.rms_norm; `quantize`: the normalized output as (q e4m3, scale), per token or under
    `input_scale`, in place of the output."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if quantize else x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x2  # x2: unused
    q = out
    if quantize:
        scale = input_scale if input_scale is not None else torch.empty(*x.shape[:-1], 1, dtype=torch.float32,
                                                                         device=x.device)
        out = (q, scale)
    if x2.shape[0] == 0:
        return out if residual is None else (out, h)
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    s = out[1] if quantize else q  # q: unused
    _RMS_NORM((x2.shape[0],), (x2, r2, weight, q, h, s, s, n, x2.stride(0), r2.stride(0), eps, residual is not None,
                               triton.next_power_of_2(n), _TL_DTYPES[x.dtype], quantize, input_scale is not None,
                               FP8_MIN_SCALE, E4M3_MAX), num_warps=4 if n <= 4096 else 8)
    return out if residual is None else (out, h)


@triton.jit
def _rotate(x_ptr, t, stride_t, stride_h, heads, cos, sin, offs_i, half_mask,
            HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < heads) & half_mask[None, :]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h
    if INTERLEAVED:
        p1 = base + 2 * offs_i[None, :]
        p2 = p1 + 1
    else:
        p1 = base + offs_i[None, :]
        p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, q_heads, k_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    half_mask = offs_i < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_i, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_i, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr, t, stride_qt, stride_qh, q_heads, cos, sin, offs_i, half_mask, HALF, INTERLEAVED, BLOCK_QH)
    _rotate(k_ptr, t, stride_kt, stride_kh, k_heads, cos, sin, offs_i, half_mask, HALF, INTERLEAVED, BLOCK_KH)


_ROPE = KeptKernel(rope_kernel)


def apply_rope_(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int,
                interleaved: bool = False) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("apply_rope_ needs q, k and cos_sin contiguous in their last dim")
    half = rotary_dim // 2
    if q.shape[0] == 0:
        return
    _ROPE((q.shape[0],), (q, k, positions, cos_sin, q.shape[1], k.shape[1], q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), cos_sin.stride(0), half, triton.next_power_of_2(half), interleaved,
                          triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])), num_warps=4)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_MUL = KeptKernel(silu_mul_kernel)


def silu_mul(gate_up: Tensor) -> Tensor:
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _SILU_MUL((x2.shape[0], triton.cdiv(inter, block)), (x2, out, inter, x2.stride(0), block), num_warps=4)
    return out
