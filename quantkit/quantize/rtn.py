"""Round-to-nearest weight quantization of every linear in the registry's blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import WeightQuantConfig
from quantkit.models.lazy import BlockWeights
from quantkit.models.registry import ArchSpec
from quantkit.quantize.primitives import (
    GroupSizeError,
    QuantizedWeight,
    quantize_weight,
)


@dataclass
class QuantizedBlock:
    """A decoder block just quantized (by `rtn_blocks` or `awq_blocks`): on the pass's device, its
    linears holding their dequantized weights; `qweights` ({full module name: QuantizedWeight}) are
    its codes on the same device."""

    index: int
    prefix: str
    layer: torch.nn.Module
    qweights: dict[str, QuantizedWeight]


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


@torch.no_grad()
def rtn_blocks(model: torch.nn.Module, spec: ArchSpec, cfg: WeightQuantConfig, device: torch.device,
               dtype: torch.dtype, blocks: Optional[BlockWeights] = None, progress: bool = True) -> Iterator[QuantizedBlock]:
    """Round-to-nearest, block by block on `device`, yielding each block as `awq_blocks` does.

    Each block is moved to `device` in `dtype`, its linears quantized (the same arithmetic as
    `quantize_block_linears`: float32 from the stored weights) and given their dequantized weights,
    so a forward of the yielded block computes what the checkpoint holds; once the caller asks for
    the next block, this one is released by `blocks` (default: back to the host). The group size was
    checked against every layer before (quantize.api)."""
    blocks = blocks or BlockWeights()
    layers = decoder_layers(model, spec)
    for i, layer in enumerate(tqdm(layers, desc=f"RTN W{cfg.bits}", disable=not progress, unit="block")):
        prefix = f"{spec.layers_path}.{i}"
        blocks.load(i, layer)
        store_dtype = next(layer.parameters()).dtype
        # Quantize from the stored weights, then move: the codes do not depend on `dtype`.
        layer.to(device=device)
        qweights = {}
        for name in spec.linears:
            lin = layer.get_submodule(name)
            qw = quantize_weight(lin.weight.data.float(), cfg)
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            qweights[f"{prefix}.{name}"] = qw
        layer.to(dtype=dtype)
        yield QuantizedBlock(i, prefix, layer, qweights)
        del qweights
        blocks.release(i, layer, store_dtype)
