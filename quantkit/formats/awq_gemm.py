"""AutoAWQ "gemm" layout, which AutoAWQ, vLLM (awq, awq_marlin), transformers and lmdeploy load.

qweight int32 [in, out/8]; qzeros int32 [in/group, out/8]; scales fp16 [in/group, out].
Eight 4-bit values per int32 packed along the output dimension: nibble i (bits 4i..4i+3) holds
column `AWQ_PACK_ORDER[i]` of its block of eight. Dequantized weight (transposed): (q − z) · s.
"""

from __future__ import annotations

import torch

BITS = 4
PACK_FACTOR = 32 // BITS
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Inverse permutation: column j of a block sits in nibble AWQ_UNPACK_ORDER[j].
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
TENSOR_NAMES = ("qweight", "qzeros", "scales")


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints in 0..15 → int32 [rows, cols/8] in AWQ nibble order."""
    rows, cols = values.shape
    if cols % PACK_FACTOR:
        raise ValueError(f"AWQ packing needs the output dimension ({cols}) to be a multiple of 8")
    v = values.to(torch.int64).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)
    v = v[:, :, list(AWQ_PACK_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(dim=-1)
    # Values ≥ 2^31 wrap to negative int32, which is what the consumers read back.
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] → int32 [rows, cols] in 0..15, undoing `_pack_cols`."""
    rows, pcols = packed.shape
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles[:, :, list(AWQ_UNPACK_ORDER)].reshape(rows, pcols * PACK_FACTOR)


def pack_awq_gemm(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """From quantkit's [out, in] integers, [out, groups] zeros and scales to the AWQ gemm tensors."""
    return {
        "qweight": _pack_cols(q.t().contiguous()),
        "qzeros": _pack_cols(zeros.t().contiguous()),
        "scales": scales.t().contiguous().to(torch.float16),
    }


def unpack_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Back to q [out, in], zeros [out, groups] (int32) and scales [out, groups]."""
    return _unpack_cols(qweight).t(), _unpack_cols(qzeros).t(), scales.t()


def quantization_config(group_size: int, modules_to_not_convert: list[str]) -> dict:
    """The config.json entry that AutoAWQ, vLLM and transformers recognise."""
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }

