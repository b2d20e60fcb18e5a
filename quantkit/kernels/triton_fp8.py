"""Triton kernels of the FP8 (e4m3) W8A8 linear (kernels/fp8.py launches them).

- `quantize_kernel`: rows of x onto the e4m3 grid, one program per row: per token (the row's
  largest |x| / 448, floored at FP8_MIN_SCALE) or under a static per-tensor scale.
- `silu_mul_quantize_kernel`: SiLU(gate)·up rounded to the model's dtype, then quantized as above: the
  MLP's activations reach the down projection as e4m3 without a 16-bit round trip through memory.
  (RMSNorm's quantizing form is triton_fused.rms_norm_kernel with QUANT.)
- `dot_kernel`: y = (q_x q_wᵀ) · s_x · s_w (+ bias) on the tensor cores, weights as the MMA's M side
  ("swap AB": at a decode step's few tokens, the weight rows fill the 64-row MMA and the tokens its
  narrow N side), K split across programs through the split-K workspace (triton_splitk). Large M goes
  to cuBLAS (torch._scaled_mm) instead; the dispatch table says where.

The roundings are the torch reference's (kernels/reference.py): x / scale divided exactly (div_rn),
clamped to ±448 and rounded to the nearest e4m3 value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import KeptKernel
from quantkit.kernels.triton_splitk import clamp_split, counters, store_tile, workspace
from quantkit.packing import E4M3_MAX, FP8_MIN_SCALE


@triton.jit
def row_scale(amax, MIN_SCALE: tl.constexpr, FP8_MAX: tl.constexpr):
    """A token's scale from its largest |x|, as reference.fp8_activation_scale computes it."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def to_e4m3(x, scale, FP8_MAX: tl.constexpr):
    """fp32 x / scale on the e4m3 grid (saturated at ±FP8_MAX), rounded to nearest even."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, n, stride_x, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                    MIN_SCALE: tl.constexpr, FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)))
        scale = row_scale(tl.max(amax, axis=0), MIN_SCALE, FP8_MAX)
        tl.store(s_ptr + row, scale)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * n + cols, to_e4m3(x, scale, FP8_MAX), mask=cols < n)


@triton.jit
def _silu_mul(x_row, cols, inter, OUT_DTYPE: tl.constexpr):
    """SiLU(gate)·up at `cols`, with the roundings of triton_fused.silu_mul_kernel (fp32 values)."""
    gate = tl.load(x_row + cols, mask=cols < inter, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=cols < inter, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
    return (act * up).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def silu_mul_quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, inter, stride_x, OUT_DTYPE: tl.constexpr,
                             STATIC: tl.constexpr, BLOCK: tl.constexpr, MIN_SCALE: tl.constexpr,
                             FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_ptr)
    else:  # a first pass for the row's largest |h|; the second recomputes h (cheaper than storing it)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, inter, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, c0 + tl.arange(0, BLOCK), inter, OUT_DTYPE)))
        scale = row_scale(tl.max(amax, axis=0), MIN_SCALE, FP8_MAX)
        tl.store(s_ptr + row, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        h = _silu_mul(x_row, cols, inter, OUT_DTYPE)
        tl.store(q_ptr + row * inter + cols, to_e4m3(h, scale, FP8_MAX), mask=cols < inter)


@triton.jit
def dot_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om,
               X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    lo = pid_k * span
    hi = tl.minimum(lo + span, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    n_ok = offs_n[:, None] < N
    m_ok = offs_m[:, None] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + offs_k)[None, :] < hi
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_ok & k_ok, other=0.0)
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok & k_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    if W_PER_CHANNEL:
        acc *= tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
    else:
        acc *= tl.load(sw_ptr)
    if X_PER_TOKEN:
        acc *= tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :]
    else:
        acc *= tl.load(sx_ptr)
    tile_id = pid_m * tl.num_programs(0) + pid_n
    store_tile(tl.trans(acc), offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, ws_ptr, cnt_ptr, tile_id, pid_k,
               SPLIT_K, SPLIT, HAS_BIAS)


_QUANTIZE = KeptKernel(quantize_kernel)
_SILU_MUL_QUANTIZE = KeptKernel(silu_mul_quantize_kernel)
_DOT = KeptKernel(dot_kernel)

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 shaped as x, scale): per token [..., 1] float32, or `input_scale` [1] when it is given."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = input_scale if input_scale is not None else torch.empty(*x.shape[:-1], 1, dtype=torch.float32,
                                                                     device=x.device)
    if x2.shape[0]:
        _QUANTIZE((x2.shape[0],), (x2, q, scale, scale, n, x2.stride(0), input_scale is not None,
                                   min(4096, triton.next_power_of_2(n)), FP8_MIN_SCALE, E4M3_MAX), num_warps=4)
    return q, scale


def silu_mul_quantize(gate_up: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(silu_mul(gate_up), input_scale) in one pass, silu_mul's output never written."""
    inter = gate_up.shape[-1] // 2
    x2 = _rows(gate_up, 2 * inter)
    q = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = input_scale if input_scale is not None else torch.empty(*gate_up.shape[:-1], 1, dtype=torch.float32,
                                                                     device=gate_up.device)
    if x2.shape[0]:
        _SILU_MUL_QUANTIZE((x2.shape[0],), (x2, q, scale, scale, inter, x2.stride(0), _TL_DTYPES[gate_up.dtype],
                                            input_scale is not None, min(2048, triton.next_power_of_2(inter)),
                                            FP8_MIN_SCALE, E4M3_MAX), num_warps=8)
    return q, scale


def dot(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
        bias: torch.Tensor | None, dtype: torch.dtype, *, block_n: int = 128, block_m: int = 16,
        block_k: int = 128, split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """y [M, N] in `dtype` = q [M, K] (e4m3) · weight [N, K]ᵀ (e4m3) · scale · weight_scale (+ bias); scale
    [M, 1] per token or [1] per tensor, weight_scale [N, 1] per channel or [1] per tensor."""
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=q.device)
    if m == 0:
        return out
    n_tiles, m_tiles = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    split_k = clamp_split(max(1, min(split_k, triton.cdiv(k, block_k))), m, n)
    ws, cnt = workspace(split_k, m, n, q.device), counters(q.device, n_tiles * m_tiles)
    _DOT((n_tiles, m_tiles, split_k), (
        q, scale, weight, weight_scale, bias if bias is not None else out, out, ws, cnt, m, n, k, q.stride(0),
        out.stride(0), scale.dim() > 1, weight_scale.dim() > 1, block_n, block_m, block_k, split_k,
        split_k > 1, bias is not None, num_stages), num_warps=num_warps, num_stages=num_stages)
    return out
