"""Whole-model quantization in memory, for tests that inspect every linear's codes at once (the package
itself quantizes block by block and streams each block to the checkpoint)."""

from __future__ import annotations

from typing import Any

import torch

from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.models.registry import ArchSpec
from quantkit.quantize.awq import awq_blocks
from quantkit.quantize.export import packed_tensors
from quantkit.quantize.primitives import QuantizedWeight
from quantkit.quantize.rtn import check_group_size, decoder_layers, quantize_block_linears


def awq_quantize(model: torch.nn.Module, spec: ArchSpec, config: QuantizeConfig, windows: torch.Tensor,
                 report: dict[str, Any], progress: bool = False) -> dict[str, QuantizedWeight]:
    """`awq_blocks` over an in-memory model, every block's codes collected on the host. Scales are folded
    into the model in place and each quantized linear holds its dequantized weight afterwards."""
    out: dict[str, QuantizedWeight] = {}
    for qb in awq_blocks(model, spec, config, windows, report, progress=progress):
        out.update({name: QuantizedWeight(qw.q.cpu(), qw.zeros.cpu(), qw.scales.cpu(), qw.bits, qw.group_size)
                    for name, qw in qb.qweights.items()})
    _assert_registry_linears(out, model, spec)
    return out


def _assert_registry_linears(qweights: dict, model: torch.nn.Module, spec: ArchSpec) -> None:
    """The codes a pass returns are for the registry's linears of the model's blocks, nothing else (a test may
    stub the quantization out, so not necessarily all of them)."""
    want = {f"{spec.layers_path}.{i}.{name}" for i in range(len(decoder_layers(model, spec))) for name in spec.linears}
    assert set(qweights) <= want, f"codes for {sorted(set(qweights) - want)[:4]}, not registry linears"


def rtn_quantize(model: torch.nn.Module, spec: ArchSpec, cfg: WeightQuantConfig) -> dict[str, QuantizedWeight]:
    """Every block linear of `model` with round-to-nearest, from the weights as they are."""
    check_group_size(model, spec, cfg)
    out: dict[str, QuantizedWeight] = {}
    for i, layer in enumerate(decoder_layers(model, spec)):
        out.update(quantize_block_linears(layer, spec, f"{spec.layers_path}.{i}", cfg))
    _assert_registry_linears(out, model, spec)
    return out


def checkpoint_tensors(model: torch.nn.Module, qweights: dict[str, QuantizedWeight], config: QuantizeConfig) -> dict:
    """A whole in-memory model's fp16 tensors with each quantized linear's weight replaced by its packed tensors
    (what the streaming export writes block by block)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    replaced = {f"{name}.weight" for name in qweights} | ({"lm_head.weight"} if tied else set())
    assert replaced <= set(model.state_dict()), "a quantized linear the model does not have"
    out = {key: t.detach().to(torch.float16).contiguous() if t.is_floating_point() else t.detach().contiguous()
           for key, t in model.state_dict().items() if key not in replaced}
    return out | packed_tensors(qweights, config)
