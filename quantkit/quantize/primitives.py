"""Tensor primitives: per-group integer quantization along the input dimension.

Convention used everywhere in quantkit: a weight W [out, in] is split into groups of `group_size`
consecutive inputs; each (row, group) has a scale s and an integer zero z, and the stored integers
q are unsigned in [0, 2^bits − 1] with W ≈ (q − z) · s. Symmetric quantization is the special case
z = 2^(bits−1), s = absmax / (2^(bits−1) − 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

import torch

from quantkit.config import UserError, WeightQuantConfig


class GroupSizeError(UserError):
    """The group size does not divide a layer's input dimension."""


@dataclass
class QuantizedWeight:
    """Integers q [out, in] (uint8/int16 holding 0..2^b−1), zeros [out, groups] int, scales [out, groups]."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.zeros, self.scales, self.group_size)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, Union[int, str]]:
        """What error-feedback rounding (rounding.gptq_round) keeps fixed: scales and zeros [out, groups] and the
        grid, here the integers 0 … 2^bits − 1."""
        return self.scales, self.zeros, 2**self.bits - 1

    def with_codes(self, codes: torch.Tensor) -> "QuantizedWeight":
        """The same scales (and zeros) with other codes [out, in] on the same grid."""
        return replace(self, q=codes.to(torch.int32))


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out_f, in_f = w.shape
    if in_f % group_size:
        raise GroupSizeError(
            f"group size {group_size} does not divide the input dimension {in_f}"
        )
    return w.reshape(out_f, in_f // group_size, group_size)


def compute_qparams(
    w: torch.Tensor, cfg: WeightQuantConfig, max_val: torch.Tensor | None = None, min_val: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [out, groups] (float32) and integer zeros [out, groups] for W [out, in].

    `max_val`/`min_val` [out, groups] replace the groups' own extremes (clip search uses this).
    """
    gs = cfg.effective_group_size(w.shape[1])
    g = _grouped(w.float(), gs)
    qmax = 2**cfg.bits - 1
    if cfg.symmetric:
        absmax = g.abs().amax(dim=-1) if max_val is None else max_val.float().abs()
        half = 2 ** (cfg.bits - 1) - 1
        scales = (absmax / half).clamp(min=1e-8)
        zeros = torch.full_like(scales, 2 ** (cfg.bits - 1))
        return scales, zeros.to(torch.int32)
    mx = g.amax(dim=-1) if max_val is None else max_val.float()
    mn = g.amin(dim=-1) if min_val is None else min_val.float()
    # The range must contain 0 so that a zero weight stays exactly representable.
    mx = mx.clamp(min=0)
    mn = mn.clamp(max=0)
    scales = ((mx - mn) / qmax).clamp(min=1e-8)
    zeros = torch.round(-mn / scales).clamp(0, qmax)
    return scales, zeros.to(torch.int32)


def quantize_with(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Integers q [out, in] (int32) for W given per-group scales and zeros."""
    g = _grouped(w.float(), group_size)
    q = torch.round(g / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1).float()
    return q.clamp(0, 2**bits - 1).to(torch.int32).reshape(w.shape)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q − z) · s as float32, [out, in]."""
    out_f, in_f = q.shape
    g = q.reshape(out_f, in_f // group_size, group_size).float()
    w = (g - zeros.unsqueeze(-1).float()) * scales.float().unsqueeze(-1)
    return w.reshape(out_f, in_f)


def quantize_weight(
    w: torch.Tensor,
    cfg: WeightQuantConfig,
    max_val: torch.Tensor | None = None,
    min_val: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedWeight:
    """Round-to-nearest quantization of W [out, in] under `cfg`.

    Scales are rounded to `scale_dtype` (what the checkpoint stores) before the integers are
    computed, so dequantizing the stored tensors gives exactly `pseudo_quantize(w)`.
    """
    gs = cfg.effective_group_size(w.shape[1])
    scales, zeros = compute_qparams(w, cfg, max_val, min_val)
    scales = scales.to(scale_dtype).float().clamp(min=torch.finfo(scale_dtype).tiny)
    q = quantize_with(w, scales, zeros, cfg.bits, gs)
    return QuantizedWeight(q=q, zeros=zeros, scales=scales, bits=cfg.bits, group_size=gs)


def pseudo_quantize(w: torch.Tensor, cfg: WeightQuantConfig, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Quantize then dequantize W, in W's dtype; scales rounded to `scale_dtype` as the checkpoint stores them."""
    return quantize_weight(w, cfg, scale_dtype=scale_dtype).dequantize().to(w.dtype)
