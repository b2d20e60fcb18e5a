"""Fp8Linear: a linear layer with e4m3 weights and activations (compressed-tensors float-quantized).

Buffers, named as the checkpoint's tensors so a state dict loads straight into it: `weight`
float8_e4m3fn [out, in], `weight_scale` float32 [out, 1] or [1], and with static activations
`input_scale` float32 [1]. Forward: the activations are rounded onto the e4m3 grid per token (dynamic)
or under `input_scale` (static) — unless they arrive so (kernels.fp8.Fp8Activations, from the fused
RMSNorm or SiLU·mul the engine links to this layer: `quantizes_input`) — then multiplied by the weight:
on a GPU with FP8 tensor cores by the FP8 product the dispatch table names, elsewhere by the torch
reference on the dequantized weight (kernels/fp8.py).

Its own module rather than a layout of QuantLinear: QuantLinear holds integer codes whose kernels
dequantize weights and keep activations in 16 bits; this layer's weights need no unpacking, its
activations are quantized too, and its GPU path (a scaled FP8 matrix product) shares nothing with
the integer kernels that QuantLinear's dispatch picks among.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels import fp8, reference
from quantkit.kernels.settings import AUTO, KernelSettings
from quantkit.nn.quant_linear import add_bias_and_weight_cache

ACTIVATIONS = ("dynamic", "static")


class Fp8Linear(nn.Module):
    """y = q(x) Wᵀ + b, W = float(weight) · weight_scale; q rounds x to e4m3 per token or per tensor."""

    LAYOUT = "fp8"
    kernels: KernelSettings = AUTO

    def __init__(self, in_features: int, out_features: int, activations: str = "dynamic", layout: str = LAYOUT,
                 per_tensor: bool = False, bias: bool = False, dtype: torch.dtype = torch.float16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown activation scheme {activations!r}; expected one of {ACTIVATIONS}")
        if layout != self.LAYOUT:
            raise ValueError(f"Fp8Linear holds the {self.LAYOUT!r} layout, not {layout!r}")
        self.in_features, self.out_features, self.activations = in_features, out_features, activations
        kw = {"device": device}
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, **kw))
        self.register_buffer("weight_scale", torch.empty((1,) if per_tensor else (out_features, 1), dtype=torch.float32, **kw))
        if activations == "static":
            self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32, **kw))
        else:
            self.input_scale = None
        add_bias_and_weight_cache(self, out_features, bias, dtype, kw)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(): the cached weight would be stale
        self._cached_weight = None
        return super()._apply(fn, recurse)

    def dequantized_weight(self) -> torch.Tensor:
        """W [out, in] in float32."""
        return reference.dequantize_fp8(self.weight, self.weight_scale)

    def _weight_for(self, device: torch.device) -> torch.Tensor:
        weight = self._cached_weight
        if weight is None or weight.device != device:
            weight = self.dequantized_weight().to(device)
            if self.cache_dequantized:
                self._cached_weight = weight
        return weight

    def forward(self, x: torch.Tensor | fp8.Fp8Activations) -> torch.Tensor:
        if not isinstance(x, fp8.Fp8Activations):
            x = fp8.quantize(x, self.input_scale, self.kernels)
        return fp8.linear(x, self.weight, self.weight_scale, self.bias, lambda: self._weight_for(x.q.device),
                          self.kernels)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations={self.activations}, bias={self.bias is not None}")
