"""The packed-weight formats quantkit writes and reads, by name: what exporters and loaders look up.

Adding a format is one module with a `WeightFormat` and one line in `FORMATS`."""

from __future__ import annotations

from typing import Any

from quantkit.config import UserError
from quantkit.formats import awq_gemm, compressed_tensors
from quantkit.formats.layout import WeightFormat

FORMATS: dict[str, WeightFormat] = {
    awq_gemm.FORMAT.name: awq_gemm.FORMAT,
    compressed_tensors.FORMAT.name: compressed_tensors.FORMAT,
}


class UnsupportedFormat(UserError):
    """A quantization_config whose tensors quantkit would misread; the message says what to do instead."""


def format_of(qc: dict[str, Any]) -> WeightFormat:
    """The format of a checkpoint's quantization_config, or UnsupportedFormat saying why it cannot be read."""
    fmt = FORMATS.get(qc.get("quant_method"))
    if fmt is None:
        raise UnsupportedFormat(f"quantization method {qc.get('quant_method')!r} is not supported; quantize the "
                                "full-precision model with `quantkit rtn|int8|awq`")
    problem = fmt.problem(qc)
    if problem:
        raise UnsupportedFormat(problem)
    return fmt
