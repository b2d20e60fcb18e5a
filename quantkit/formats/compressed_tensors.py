"""compressed-tensors "pack-quantized", which vLLM, llm-compressor and transformers load (4 or 8 bits).

weight_packed int32 [out, ceil(in·b/32)]: values packed sequentially along the input dimension,
value k of a word in bits b·k..b·k+b−1, each stored as the signed integer plus 2^(b−1).
weight_scale [out, groups]; weight_zero_point int32 packed the same way along dim 0 (asymmetric
only); weight_shape int64 [2]. Dequantized weight: (q_signed − z_signed) · s.
quantkit's unsigned integers q ∈ [0, 2^b) map to q_signed = q − 2^(b−1), so the packed bits are q.

Static KV-cache scales, where calibration measured K and V: `<attention>.k_scale` / `.v_scale`,
float32 [1] per layer, with a `kv_cache_scheme` of 8-bit float, strategy "tensor" (what
llm-compressor writes). vLLM maps them onto its attention layers and, when `kv_cache_dtype` is left
"auto", keeps an fp8 e4m3 KV cache that stores K / k_scale. One scale per layer rather than per head
("attn_head"): vLLM takes per-head scales only on FlashAttention 3; its CPU and other backends use
one number per layer anyway (the largest head's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from quantkit.formats.layout import Tensors, WeightFormat, WeightLayout
from quantkit.packing import E4M3_MAX as FP8_E4M3_MAX  # noqa: F401  (vLLM's fp8 KV scales: absmax / 448)
from quantkit.packing import pack_words, unpack_words

TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
KV_SCALE_NAMES = ("k_scale", "v_scale")


def pack_compressed(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, symmetric: bool
) -> dict[str, torch.Tensor]:
    """From quantkit's q [out, in], zeros and scales [out, groups] to pack-quantized tensors."""
    out = {
        "weight_packed": pack_words(q, bits),
        "weight_scale": scales.to(torch.float16).contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_words(zeros.t().contiguous(), bits).t().contiguous()
    return out


def unpack_compressed(tensors: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Back to q [out, in], zeros [out, groups] (int32) and scales [out, groups]."""
    out_f, in_f = (int(x) for x in tensors["weight_shape"].tolist())
    q = unpack_words(tensors["weight_packed"], bits, in_f)
    scales = tensors["weight_scale"]
    if tensors.get("weight_zero_point") is not None:
        zeros = unpack_words(tensors["weight_zero_point"].t().contiguous(), bits, out_f).t()
    else:
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int32, device=scales.device)
    return q, zeros, scales


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict:
    """The config.json entry vLLM and transformers read for a weight-only pack-quantized model."""
    strategy = "channel" if group_size == -1 else "group"
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": bits,
                    "type": "int",
                    "symmetric": symmetric,
                    "strategy": strategy,
                    "group_size": None if group_size == -1 else group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


class CompressedTensors(WeightFormat):
    name = "compressed-tensors"
    tensor_names = TENSOR_NAMES
    writes_kv_scales = True

    def claims(self, qc: dict[str, Any]) -> bool:
        return qc.get("format", "pack-quantized") == "pack-quantized"

    def problem(self, qc: dict[str, Any]) -> Optional[str]:
        """Formats other than pack-quantized and float-quantized (sparse, naive, …) are refused."""
        if not self.claims(qc):
            return (f"compressed-tensors format {qc['format']!r} is not supported, only 'pack-quantized' "
                    "(weight-only int4/int8) and 'float-quantized' (FP8): re-quantize with `quantkit rtn|int8|awq|fp8`")
        return None

    def read_layout(self, qc: dict[str, Any]) -> WeightLayout:
        weights = next(iter(qc["config_groups"].values()))["weights"]
        group_size = -1 if weights.get("strategy") == "channel" else int(weights["group_size"])
        return WeightLayout(int(weights["num_bits"]), group_size, bool(weights["symmetric"]))

    def write_config(self, layout: WeightLayout, ignore: list[str]) -> dict[str, Any]:
        return quantization_config(layout.bits, layout.group_size, layout.symmetric, ignore)

    def pack(self, q, zeros, scales, layout: WeightLayout, input_scale=None) -> Tensors:
        return pack_compressed(q, zeros, scales, layout.bits, layout.symmetric)

    def unpack(self, tensors: Tensors, layout: WeightLayout):
        return unpack_compressed(tensors, layout.bits)

    def linear_args(self, tensors: Tensors, layout: WeightLayout) -> dict[str, Any]:
        out_f, in_f = (int(x) for x in tensors["weight_shape"].tolist())
        return dict(in_features=in_f, out_features=out_f, bits=layout.bits, layout="packed",
                    group_size=in_f // tensors["weight_scale"].shape[1],
                    symmetric=tensors.get("weight_zero_point") is None)

    def join(self, parts: list[Tensors], layout: WeightLayout) -> Tensors:
        """Outputs run along dim 0. Zero points pack 32/b output rows per word: where a part's rows do not
        fill its last word, they are unpacked, joined and packed again."""
        cat = lambda name: torch.cat([p[name] for p in parts], dim=0)  # noqa: E731
        symmetric = parts[0].get("weight_zero_point") is None
        outs = [int(p["weight_shape"][0]) for p in parts]
        if symmetric or all(o % (32 // layout.bits) == 0 for o in outs):
            tensors = {"weight_packed": cat("weight_packed"), "weight_scale": cat("weight_scale")}
            if not symmetric:
                tensors["weight_zero_point"] = cat("weight_zero_point")
        else:
            unpacked = [unpack_compressed(p, layout.bits) for p in parts]
            q, z, s = (torch.cat([u[i] for u in unpacked], dim=0) for i in range(3))
            tensors = pack_compressed(q, z, s, layout.bits, symmetric)
            tensors["weight_scale"] = s
        in_f = int(parts[0]["weight_shape"][1])
        tensors["weight_shape"] = torch.tensor([sum(outs), in_f], dtype=torch.int64, device=tensors["weight_packed"].device)
        return tensors


FORMAT = CompressedTensors()


def kv_cache_scheme() -> dict:
    """quantization_config["kv_cache_scheme"] for the scales of `kv_cache_scales`: fp8, per tensor."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
            "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def kv_cache_scales(attention_modules: list[str], k_absmax: torch.Tensor, v_absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """`<module>.k_scale` / `.v_scale` for each layer's attention module: the layer's largest |K|
    (|V|) over heads and channels divided by the fp8 e4m3 maximum, float32 [1].
    `k_absmax` / `v_absmax` are [layers, ...] with one row per entry of `attention_modules`."""
    if not (len(attention_modules) == k_absmax.shape[0] == v_absmax.shape[0]):
        raise ValueError(f"{len(attention_modules)} attention modules but statistics for {k_absmax.shape[0]} layers")
    out = {}
    for i, module in enumerate(attention_modules):
        for name, absmax in zip(KV_SCALE_NAMES, (k_absmax[i], v_absmax[i])):
            # A layer whose K or V is all zero still needs a positive scale: vLLM reads ≤ 0 as "absent".
            scale = absmax.float().max().clamp_min(1e-8) / FP8_E4M3_MAX
            out[f"{module}.{name}"] = scale.reshape(1).contiguous()
    return out

