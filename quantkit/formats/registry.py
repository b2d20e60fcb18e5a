"""The packed-weight formats quantkit writes and reads, by name: what exporters and loaders look up.

Adding a format is one module with a `WeightFormat` and one line in `FORMATS`. Formats that share a
quant_method (compressed-tensors pack-quantized and float-quantized) are told apart by their `claims`."""

from __future__ import annotations

from typing import Any

from quantkit.config import UserError
from quantkit.formats import awq_gemm, compressed_tensors, fp8
from quantkit.formats.layout import WeightFormat

FORMATS: dict[str, WeightFormat] = {
    awq_gemm.FORMAT.name: awq_gemm.FORMAT,
    compressed_tensors.FORMAT.name: compressed_tensors.FORMAT,
    fp8.FORMAT.name: fp8.FORMAT,
}
# What config.json's quant_method says for a checkpoint quantkit may read.
QUANT_METHODS: tuple[str, ...] = tuple(dict.fromkeys(f.quant_method for f in FORMATS.values()))


class UnsupportedFormat(UserError):
    """A quantization_config whose tensors quantkit would misread; the message says what to do instead."""


def format_of(qc: dict[str, Any]) -> WeightFormat:
    """The format of a checkpoint's quantization_config, or UnsupportedFormat saying why it cannot be read."""
    candidates = [f for f in FORMATS.values() if f.quant_method == qc.get("quant_method")]
    if not candidates:
        raise UnsupportedFormat(f"quantization method {qc.get('quant_method')!r} is not supported; quantize the "
                                "full-precision model with `quantkit rtn|int8|awq|fp8`")
    # None claiming it: the first explains the refusal.
    fmt = next((f for f in candidates if f.claims(qc)), candidates[0])
    problem = fmt.problem(qc)
    if problem:
        raise UnsupportedFormat(problem)
    return fmt
