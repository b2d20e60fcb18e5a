"""The FP8 (e4m3) W8A8 linear: y = q(x) · q(W)ᵀ · s_x · s_w (+ b), on the kernel the dispatch table names.

Activations arrive quantized (`Fp8Activations`) from the op that made them where the engine fuses it
(RMSNorm, SiLU·mul: fused.rms_norm / fused.silu_mul with `quantize`), or are quantized here first. On a
GPU with FP8 tensor cores (hardware.fp8_kernels) the product runs on the table's kernel for its M: the
Triton swap-AB kernel (triton_fp8.dot) at small M, cuBLAS (torch._scaled_mm) above. Elsewhere the torch
reference computes the same product from the dequantized weight (the CPU's emulation: `eval ppl` there
measures what the GPU serves).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from quantkit.kernels import reference
from quantkit.kernels.dispatch_table import Choice, choose_fp8
from quantkit.kernels.hardware import fp8_kernels
from quantkit.kernels.settings import AUTO, KernelSettings


class Fp8Activations(NamedTuple):
    """Activations on the e4m3 grid: `q` float8_e4m3fn shaped as the activations, `scale` float32 [..., 1]
    per token or [1] per tensor (static), `dtype` the activations' own (the product's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def runs_kernels(kernels: KernelSettings, device: torch.device) -> bool:
    """Whether the FP8 Triton kernels (and cuBLAS's FP8 product) run on `device`, else the torch reference."""
    return kernels.triton(device) and fp8_kernels(device)


def quantize(x: torch.Tensor, input_scale: torch.Tensor | None, kernels: KernelSettings = AUTO) -> Fp8Activations:
    """x on the e4m3 grid per token (`input_scale` None) or under the static `input_scale`."""
    if runs_kernels(kernels, x.device):
        from quantkit.kernels import triton_fp8

        return Fp8Activations(*triton_fp8.quantize(x, input_scale), x.dtype)
    return Fp8Activations(*reference.quantize_fp8(x, input_scale), x.dtype)


def linear(x: Fp8Activations, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           dequantized: Callable[[], torch.Tensor], kernels: KernelSettings = AUTO) -> torch.Tensor:
    """y [..., N] in x.dtype for weight e4m3 [N, K] with weight_scale [N, 1] or [1]; `dequantized()` gives
    the float32 weight the torch reference multiplies (a layer may keep it)."""
    lead, k = x.q.shape[:-1], x.q.shape[-1]
    q = x.q.reshape(-1, k)
    scale = x.scale.reshape(-1, 1) if x.scale.dim() > 1 else x.scale.reshape(1)  # per token [..., 1], or static [1]
    if not runs_kernels(kernels, q.device):
        y = F.linear(q.float() * scale, dequantized().to(q.device))
        y = y if bias is None else y + bias.float()
        return y.to(x.dtype).reshape(*lead, -1)
    choice = choice_for(q.shape[0], weight.shape[0], k, q.device, kernels)
    if choice.method == "scaled_mm":
        y = scaled_mm(q, scale, weight, weight_scale, bias, x.dtype)
    else:
        from quantkit.kernels import triton_fp8

        y = triton_fp8.dot(q, scale, weight, weight_scale, bias, x.dtype, **choice.params)
    return y.reshape(*lead, -1)


def choice_for(m: int, n: int, k: int, device: torch.device, kernels: KernelSettings = AUTO) -> Choice:
    """The table's kernel for M rows on an N × K FP8 layer; cuBLAS only on CUDA and for its shapes (N and K
    multiples of 16), the Triton kernel otherwise."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    choice = choose_fp8(m, n, k, sms, kernels.dispatch_rows())
    if choice.method == "scaled_mm" and (device.type != "cuda" or n % 16 or k % 16):
        return choose_fp8(m, n, k, sms, kernels.dispatch_rows(), triton_only=True)
    return choice


def scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 product (torch._scaled_mm): per-tensor scales as scalars, else row-wise (scale [M, 1],
    weight_scale [1, N]), in `dtype` or, where this torch's row-wise product refuses it, in bf16 and cast."""
    m, n = q.shape[0], weight.shape[0]
    sa, sb = scale.reshape(-1, 1), weight_scale.reshape(1, -1)
    rowwise = sa.numel() > 1 or sb.numel() > 1
    if rowwise:
        sa = sa.expand(m, 1).contiguous() if sa.shape[0] != m else sa
        sb = sb.expand(1, n).contiguous() if sb.shape[1] != n else sb
        out_dtype = _rowwise_dtype(q.device, dtype)
    else:
        sa, sb, out_dtype = sa.reshape(()), sb.reshape(()), dtype
    fused_bias = bias if not rowwise else None  # torch versions differ on a bias with row-wise scales: added after
    y = torch._scaled_mm(q, weight.t(), scale_a=sa, scale_b=sb, bias=fused_bias, out_dtype=out_dtype)
    if out_dtype != dtype:
        y = y.to(dtype)
    return y if bias is None or fused_bias is not None else y + bias


@functools.cache
def _rowwise_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """`dtype` if torch._scaled_mm's row-wise product writes it on `device` (tried once, on a 16 × 16
    problem: call it outside CUDA-graph capture first, as the engine's warm-up does), else bf16."""
    q = torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device=device)
    ones = torch.ones(16, 1, dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(q, q.t(), scale_a=ones, scale_b=ones.t(), out_dtype=dtype)
    except RuntimeError:
        return torch.bfloat16
    return dtype
