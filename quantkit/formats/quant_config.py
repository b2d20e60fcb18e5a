"""Which `quantization_config` layouts quantkit's packed-weight readers take (both loaders ask here)."""

from __future__ import annotations

from typing import Any, Optional

METHODS = ("awq", "compressed-tensors")


def layout_problem(qc: dict[str, Any]) -> Optional[str]:
    """Why the tensors of a checkpoint with this quantization_config would be misread, or None.

    AWQ versions other than gemm (gemv, gemv_fast, marlin pack the words differently; a missing
    version is gemm, as in AutoAWQ) and other bit widths; compressed-tensors formats other than
    pack-quantized; any other method."""
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm"))
        if version.lower() != "gemm":
            return (f"AWQ version {version!r} is not supported, only 'gemm': re-quantize with `quantkit awq` "
                    "(or AutoAWQ with version='gemm')")
        if int(qc.get("bits", 4)) != 4:
            return f"AWQ with {qc['bits']} bits is not supported, only 4"
        return None
    if method == "compressed-tensors":
        if qc.get("format", "pack-quantized") != "pack-quantized":
            return (f"compressed-tensors format {qc['format']!r} is not supported, only 'pack-quantized' "
                    "(weight-only int4/int8): re-quantize with `quantkit rtn|int8|awq`")
        return None
    return (f"quantization method {method!r} is not supported; quantize the full-precision model with "
            "`quantkit rtn|int8|awq`")
