"""QuantLinear: a linear layer whose weight is stored packed, in one of two kernel layouts.

layout "awq"    → buffers qweight, qzeros, scales (AWQ gemm, 4-bit)
layout "packed" → buffers weight_packed, weight_scale, weight_zero_point (asymmetric only),
                  weight_shape (compressed-tensors pack-quantized, 4 or 8 bit)
The buffer names are the checkpoint's tensor names, so a state dict loads straight into it. Its
`kernels` (kernels.settings.KernelSettings; by default the Triton kernels where the GPU takes them) say
whether forward runs them or the torch reference; loaders set them from their caller's settings.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.kernels import reference
from quantkit.kernels.settings import AUTO, KernelSettings

LAYOUTS = ("awq", "packed")


def add_bias_and_weight_cache(layer: nn.Module, out_features: int, bias: bool, dtype: torch.dtype, kw: dict) -> None:
    """A packed linear's optional `bias` buffer, and the dequantized weight its reference path may keep
    after the first use (`cache_dequantized`: CPU evaluation, speed over memory)."""
    if bias:
        layer.register_buffer("bias", torch.empty(out_features, dtype=dtype, **kw))
    else:
        layer.bias = None
    layer.cache_dequantized = False
    layer._cached_weight = None


class QuantLinear(nn.Module):
    """y = x Wᵀ + b with W = (q − z) · s held packed; see the module docstring for the layouts."""

    kernels: KernelSettings = AUTO

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        layout: str = "awq",
        symmetric: bool = False,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        if layout == "awq" and bits != 4:
            raise ValueError("the AWQ layout holds 4-bit weights only")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.layout, self.symmetric = bits, layout, symmetric
        self.group_size = in_features if group_size == -1 else group_size
        groups = in_features // self.group_size
        kw = {"device": device}
        if layout == "awq":
            self.register_buffer("qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32, **kw))
            self.register_buffer("qzeros", torch.empty(groups, out_features // 8, dtype=torch.int32, **kw))
            self.register_buffer("scales", torch.empty(groups, out_features, dtype=dtype, **kw))
        else:
            per_word = 32 // bits
            self.register_buffer(
                "weight_packed", torch.empty(out_features, -(-in_features // per_word), dtype=torch.int32, **kw)
            )
            self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=dtype, **kw))
            self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64))
            if symmetric:
                self.weight_zero_point = None
            else:
                self.register_buffer(
                    "weight_zero_point", torch.empty(-(-out_features // per_word), groups, dtype=torch.int32, **kw)
                )
        add_bias_and_weight_cache(self, out_features, bias, dtype, kw)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(), …: the kernel layout is rebuilt lazily
        self.__dict__.pop("_kernel_weights", None)
        return super()._apply(fn, recurse)

    def offload_checkpoint_tensors(self) -> None:
        """Move the packed checkpoint tensors (not the bias) to host memory.

        Called by the kernel dispatch once it has repacked them into the layout its kernels read
        (kept on the layer as `_kernel_weights`), so the accelerator holds one copy of the weight.
        The state dict keeps every tensor; the reference path dequantizes on the host.
        """
        names = ("qweight", "qzeros", "scales") if self.layout == "awq" else ("weight_packed", "weight_scale", "weight_zero_point")
        for name in names:
            t = self._buffers.get(name)
            if t is not None and t.device.type != "cpu":
                self._buffers[name] = t.cpu()
        self._cached_weight = None

    def dequantized_weight(self) -> torch.Tensor:
        """W [out, in] in float32 (the reference the kernels are tested against)."""
        if self.layout == "awq":
            return reference.dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size)
        return reference.dequantize_packed(
            self.weight_packed, self.weight_scale, self.weight_zero_point,
            self.out_features, self.in_features, self.bits, self.group_size,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.triton(x.device):
            from quantkit.kernels import dispatch  # imported lazily: Triton is optional

            return dispatch.quant_linear(x, self)
        weight = self._cached_weight if self.cache_dequantized else None
        if weight is None or weight.dtype != x.dtype or weight.device != x.device:
            weight = self.dequantized_weight().to(device=x.device, dtype=x.dtype)
            if self.cache_dequantized:
                self._cached_weight = weight
        return torch.nn.functional.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, layout={self.layout}, bias={self.bias is not None}"
        )
