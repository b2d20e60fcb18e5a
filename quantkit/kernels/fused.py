"""The decoder's elementwise ops, fused: RMSNorm with the residual add, RoPE in place on q and k, SiLU·mul.

Each runs the Triton kernel of kernels/triton_fused.py where its `kernels` say so (KernelSettings.triton:
by default an NVIDIA GPU of compute capability 8.0 or later) and the torch code here elsewhere.
The roundings follow transformers' Llama modules, so that greedy tokens match theirs: the residual sum
and the normalized activations are rounded to the model's dtype before the weight multiplies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from quantkit.kernels import reference
from quantkit.kernels.hardware import fp8_kernels
from quantkit.kernels.settings import AUTO, KernelSettings


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
             kernels: KernelSettings = AUTO, quantize: bool = False, input_scale: Tensor | None = None):
    """norm(x) · weight over the last dim; with `residual`, h = x + residual and (norm(h) · weight, h).
    `quantize`: the normalized output as (q e4m3, scale) for an FP8 linear, per token or under the static
    `input_scale` (reference.quantize_fp8 of the output in x's dtype)."""
    if kernels.triton(x.device) and (not quantize or fp8_kernels(x.device)):
        from quantkit.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual, quantize, input_scale)
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    if quantize:
        out = reference.quantize_fp8(out, input_scale)
    return out if residual is None else (out, h)


def apply_rope_(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int,
                interleaved: bool = False, kernels: KernelSettings = AUTO) -> None:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place on their first `rotary_dim` channels.

    cos_sin [max_pos, rotary_dim] = cat(cos, sin) of the rotary_dim / 2 frequencies. Channel pairs are
    (i, i + rotary_dim / 2) (neox halves, transformers' rotate_half) or, `interleaved`, (2i, 2i + 1)."""
    if kernels.triton(q.device):
        from quantkit.kernels import triton_fused

        return triton_fused.apply_rope_(q, k, positions, cos_sin, rotary_dim, interleaved)
    half = rotary_dim // 2
    cs = cos_sin[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        r = x[..., :rotary_dim]
        x1, x2 = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
        x1f, x2f = x1.float(), x2.float()
        y1, y2 = x1f * cos - x2f * sin, x2f * cos + x1f * sin
        if interleaved:
            r.copy_(torch.stack((y1, y2), dim=-1).flatten(-2))
        else:
            r.copy_(torch.cat((y1, y2), dim=-1))


def silu_mul(gate_up: Tensor, kernels: KernelSettings = AUTO, quantize: bool = False,
             input_scale: Tensor | None = None):
    """silu(gate_up[..., :I]) · gate_up[..., I:] for gate_up [..., 2I]; `quantize`: as (q e4m3, scale), as
    rms_norm gives them."""
    if kernels.triton(gate_up.device) and (not quantize or fp8_kernels(gate_up.device)):
        from quantkit.kernels import triton_fp8, triton_fused

        if quantize:
            return triton_fp8.silu_mul_quantize(gate_up, input_scale)
        return triton_fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return reference.quantize_fp8(out, input_scale) if quantize else out
