"""compressed-tensors "float-quantized" FP8 (W8A8, e4m3), as llm-compressor writes FP8_DYNAMIC and FP8;
vLLM (Hopper FP8 GEMMs, Marlin FP8 elsewhere) and transformers with compressed-tensors load it.

Per linear: `weight` float8_e4m3fn [out, in]; `weight_scale` float32 [out, 1] (strategy "channel") or
[1] (strategy "tensor"); W = float(weight) · weight_scale. Activations are quantized to e4m3 at run
time: per token with absmax / 448 ("dynamic", strategy "token"), or with the stored per-tensor
`input_scale` float32 [1] ("static", strategy "tensor"). config.json: quant_method "compressed-tensors",
format "float-quantized", one config group targeting Linear, ignore [lm_head].

It shares quant_method with pack-quantized (formats/compressed_tensors.py); the registry tells them
apart by the config's `format`. Its registry name, "float-quantized", is that field's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from quantkit.config import FP8_FORMAT, QuantizeConfig
from quantkit.formats.layout import Tensors, WeightFormat, WeightLayout
from quantkit.packing import E4M3_MAX, dequantize_fp8, encode_e4m3  # noqa: F401  (this format's encoding)

QUANT_METHOD = "compressed-tensors"
TENSOR_NAMES = ("weight", "weight_scale", "input_scale")
WEIGHT_STRATEGIES = ("channel", "tensor")
ACTIVATIONS = {"dynamic": "token", "static": "tensor"}  # our scheme → compressed-tensors' activation strategy


@dataclass(frozen=True)
class Fp8Layout(WeightLayout):
    """FP8 weights, one scale per output channel or per tensor (`weight_strategy`), and activations
    quantized per token at run time ("dynamic") or with a calibrated per-tensor scale ("static")."""

    bits: int = 8
    group_size: int = -1
    symmetric: bool = True
    weight_strategy: str = "channel"
    activations: str = "dynamic"

    @property
    def scale_group(self) -> int:
        return 0 if self.weight_strategy == "tensor" else -1


def pack_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> Tensors:
    """One linear's tensors from its e4m3 weight [out, in] and fp32 scales ([out, 1] or [1]; input [1])."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weights must be float8_e4m3fn, not {weight.dtype}")
    out = {"weight": weight.contiguous(), "weight_scale": weight_scale.to(torch.float32).contiguous()}
    if input_scale is not None:
        out["input_scale"] = input_scale.to(torch.float32).reshape(1).contiguous()
    return out


def _args(strategy: str, dynamic: bool, observer: Optional[str]) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": observer,
            "observer_kwargs": {}}


def quantization_config(layout: Fp8Layout, ignore: list[str]) -> dict[str, Any]:
    """The config.json entry llm-compressor writes for FP8_DYNAMIC (dynamic) or FP8 (static)."""
    dynamic = layout.activations == "dynamic"
    return {
        "quant_method": QUANT_METHOD,
        "format": FP8_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _args(layout.weight_strategy, False, "minmax"),
                "input_activations": _args(ACTIVATIONS[layout.activations], dynamic, None if dynamic else "minmax"),
                "output_activations": None,
                "format": FP8_FORMAT,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


class FloatQuantized(WeightFormat):
    name = FP8_FORMAT
    quant_method = QUANT_METHOD
    tensor_names = TENSOR_NAMES
    marker = "weight_scale"  # a full-precision linear has a `weight` too
    writes_kv_scales = True

    def claims(self, qc: dict[str, Any]) -> bool:
        return qc.get("format") == FP8_FORMAT

    def problem(self, qc: dict[str, Any]) -> Optional[str]:
        """Only what FP8_DYNAMIC / FP8 write: 8-bit float weights per channel or tensor, activations per
        token (dynamic) or per tensor (static); block-wise or weight-only FP8 is refused."""
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            return f"compressed-tensors FP8 with {len(groups)} config groups is not supported, only one"
        w, a = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
        redo = "re-quantize the full-precision model with `quantkit fp8`"
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in WEIGHT_STRATEGIES:
            return (f"FP8 weights of type {w.get('type')!r}, {w.get('num_bits')} bits, strategy {w.get('strategy')!r} "
                    f"are not supported, only 8-bit float per channel or tensor: {redo}")
        if (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic"))) not in (
                ("float", 8, "token", True), ("float", 8, "tensor", False)):
            return (f"FP8 activations {a or None} are not supported, only 8-bit float per token (dynamic) or per "
                    f"tensor (static): {redo}")
        return None

    def read_layout(self, qc: dict[str, Any]) -> Fp8Layout:
        group = next(iter(qc["config_groups"].values()))
        dynamic = bool(group["input_activations"]["dynamic"])
        return Fp8Layout(weight_strategy=group["weights"]["strategy"], activations="dynamic" if dynamic else "static")

    def layout_of(self, config: QuantizeConfig) -> Fp8Layout:
        return Fp8Layout(weight_strategy=config.fp8.weight_strategy, activations=config.fp8.scheme)

    def write_config(self, layout: Fp8Layout, ignore: list[str]) -> dict[str, Any]:
        return quantization_config(layout, ignore)

    def pack(self, q, zeros, scales, layout: Fp8Layout, input_scale: Optional[torch.Tensor] = None) -> Tensors:
        """`q` is the e4m3 weight, `scales` its scale ([out, 1] or [1]), `zeros` unused (symmetric)."""
        if (layout.activations == "static") != (input_scale is not None):
            raise ValueError(f"FP8 {layout.activations} activations {'need' if input_scale is None else 'take no'} input_scale")
        return pack_fp8(q, scales, input_scale)

    def unpack(self, tensors: Tensors, layout: Fp8Layout):
        """(e4m3 weight [out, in], None, weight_scale): the pack's inputs."""
        return tensors["weight"], None, tensors["weight_scale"]

    def linear_args(self, tensors: Tensors, layout: Fp8Layout) -> dict[str, Any]:
        out_f, in_f = tensors["weight"].shape
        return dict(in_features=in_f, out_features=out_f, layout="fp8", activations=layout.activations,
                    per_tensor=tensors["weight_scale"].dim() == 1)

    def join(self, parts: list[Tensors], layout: Fp8Layout) -> Tensors:
        """Outputs run along dim 0. A per-tensor weight scale becomes one row per output channel (exact: the
        same numbers, per channel); the static input scales of linears sharing an input are its largest
        (they are equal when measured on the same input; vLLM takes the largest too)."""
        if len(parts) == 1:
            return dict(parts[0])
        scales = [p["weight_scale"].float().reshape(-1, 1).expand(p["weight"].shape[0], 1) for p in parts]
        tensors = {"weight": torch.cat([p["weight"] for p in parts], dim=0),
                   "weight_scale": torch.cat(scales, dim=0).contiguous()}
        if "input_scale" in parts[0]:
            tensors["input_scale"] = torch.stack([p["input_scale"].float().reshape(()) for p in parts]).amax().reshape(1)
        return tensors


FORMAT = FloatQuantized()
