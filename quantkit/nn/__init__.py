"""Modules that hold quantized weights."""

from quantkit.nn.fp8_linear import Fp8Linear
from quantkit.nn.quant_linear import QuantLinear

__all__ = ["Fp8Linear", "QuantLinear"]
