"""Round-to-nearest weight quantization of every linear in the registry's blocks."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from quantkit.config import WeightQuantConfig
from quantkit.models.registry import ArchSpec
from quantkit.quantize.primitives import (
    GroupSizeError,
    QuantizedWeight,
    quantize_weight,
)


def decoder_layers(model: torch.nn.Module, spec: ArchSpec) -> torch.nn.ModuleList:
    """The model's decoder layers, found at the registry's path."""
    return model.get_submodule(spec.layers_path)


def check_group_size(model: torch.nn.Module, spec: ArchSpec, cfg: WeightQuantConfig) -> None:
    """Refuse, before any work, a group size that does not divide some layer's input dimension."""
    if cfg.group_size == -1:
        return
    for i, layer in enumerate(decoder_layers(model, spec)):
        for name in spec.linears:
            in_f = layer.get_submodule(name).in_features
            if in_f % cfg.group_size:
                raise GroupSizeError(
                    f"--group-size {cfg.group_size} does not divide the input dimension {in_f} of "
                    f"{spec.layers_path}.{i}.{name}; choose a group size that divides it (e.g. 64 or 32) or -1"
                )


def quantize_block_linears(
    layer: torch.nn.Module, spec: ArchSpec, prefix: str, cfg: WeightQuantConfig
) -> dict[str, QuantizedWeight]:
    """RTN-quantize the block's linears as they are now; keys are full module names."""
    out = {}
    for name in spec.linears:
        w = layer.get_submodule(name).weight.data
        out[f"{prefix}.{name}"] = quantize_weight(w.float(), cfg)
    return out


def rtn_quantize(model: torch.nn.Module, spec: ArchSpec, cfg: WeightQuantConfig, progress: bool = True) -> dict[str, QuantizedWeight]:
    """Quantize every block linear of `model` with round-to-nearest."""
    check_group_size(model, spec, cfg)
    out: dict[str, QuantizedWeight] = {}
    layers = decoder_layers(model, spec)
    for i, layer in enumerate(tqdm(layers, desc=f"RTN W{cfg.bits}", disable=not progress, unit="block")):
        out.update(quantize_block_linears(layer, spec, f"{spec.layers_path}.{i}", cfg))
    return out
