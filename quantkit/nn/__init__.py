"""Modules that hold quantized weights."""

from quantkit.nn.quant_linear import QuantLinear

__all__ = ["QuantLinear"]
