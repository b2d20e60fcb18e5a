"""AutoAWQ "gemm" layout, which AutoAWQ, vLLM (awq, awq_marlin), transformers and lmdeploy load.

qweight int32 [in, out/8]; qzeros int32 [in/group, out/8]; scales fp16 [in/group, out].
Eight 4-bit values per int32 packed along the output dimension: nibble i (bits 4i..4i+3) holds
column `AWQ_PACK_ORDER[i]` of its block of eight. Dequantized weight (transposed): (q − z) · s.
config.json: quant_method "awq", version "gemm" (a missing version is gemm, as in AutoAWQ), bits 4.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from quantkit.formats.layout import Tensors, WeightFormat, WeightLayout
from quantkit.packing import AWQ_ORDER as AWQ_PACK_ORDER
from quantkit.packing import pack_words, unpack_words

BITS = 4
PACK_FACTOR = 32 // BITS
TENSOR_NAMES = ("qweight", "qzeros", "scales")


def pack_awq_gemm(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """From quantkit's [out, in] integers, [out, groups] zeros and scales to the AWQ gemm tensors."""
    if q.shape[0] % PACK_FACTOR:
        raise ValueError(f"AWQ packing needs the output dimension ({q.shape[0]}) to be a multiple of 8")
    return {"qweight": pack_words(q.t().contiguous(), BITS, AWQ_PACK_ORDER),
            "qzeros": pack_words(zeros.t().contiguous(), BITS, AWQ_PACK_ORDER),
            "scales": scales.t().contiguous().to(torch.float16)}


def unpack_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Back to q [out, in], zeros [out, groups] (int32) and scales [out, groups]."""
    out_f = scales.shape[1]
    return (unpack_words(qweight, BITS, out_f, AWQ_PACK_ORDER).t(), unpack_words(qzeros, BITS, out_f, AWQ_PACK_ORDER).t(),
            scales.t())


class AwqGemm(WeightFormat):
    name = "awq"
    tensor_names = TENSOR_NAMES
    fp16_activations = True

    def problem(self, qc: dict[str, Any]) -> Optional[str]:
        """Other versions (gemv, gemv_fast, marlin pack the words differently) and bit widths are refused."""
        version = str(qc.get("version", "gemm"))
        if version.lower() != "gemm":
            return (f"AWQ version {version!r} is not supported, only 'gemm': re-quantize with `quantkit awq` "
                    "(or AutoAWQ with version='gemm')")
        if int(qc.get("bits", BITS)) != BITS:
            return f"AWQ with {qc['bits']} bits is not supported, only 4"
        return None

    def read_layout(self, qc: dict[str, Any]) -> WeightLayout:
        return WeightLayout(int(qc.get("bits", BITS)), int(qc["group_size"]), not qc.get("zero_point", True))

    def write_config(self, layout: WeightLayout, ignore: list[str]) -> dict[str, Any]:
        """The entry AutoAWQ, vLLM and transformers recognise."""
        return {"quant_method": "awq", "bits": BITS, "group_size": layout.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": ignore}

    def pack(self, q, zeros, scales, layout: WeightLayout, input_scale=None) -> Tensors:
        return pack_awq_gemm(q, zeros, scales)

    def unpack(self, tensors: Tensors, layout: WeightLayout):
        return unpack_awq_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"])

    def linear_args(self, tensors: Tensors, layout: WeightLayout) -> dict[str, Any]:
        in_f, (groups, out_f) = tensors["qweight"].shape[0], tensors["scales"].shape
        return dict(in_features=in_f, out_features=out_f, bits=BITS, group_size=in_f // groups, layout="awq")

    def join(self, parts: list[Tensors], layout: WeightLayout) -> Tensors:
        """Outputs run along dim 1 of all three tensors, eight columns per word."""
        return {name: torch.cat([p[name] for p in parts], dim=1) for name in TENSOR_NAMES}


FORMAT = AwqGemm()
