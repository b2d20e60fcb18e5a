"""Checkpoint → DecoderModel: reads a checkpoint a layer at a time and fuses q/k/v and gate/up.

Sources: a full-precision HF directory (safetensors or .bin; InternLM2 renamed and its wqkv split by
models/internlm2.py) or a quantkit export (AWQ gemm or compressed-tensors pack-quantized: QuantLinear
layers; compressed-tensors float-quantized: Fp8Linear layers). Fusing concatenates along the output
dimension, whose position differs per layout: AWQ gemm packs it along dim 1 of qweight/qzeros/scales,
compressed-tensors along dim 0 of weight_packed/weight_scale/weight_zero_point (and FP8's weight/weight_scale).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from quantkit.formats.kv_stats import LEGACY_FILE_NAME as KV_STATS_AT_ROOT  # no weights: never read as such
from quantkit.formats.layout import WeightFormat, WeightLayout
from quantkit.formats.registry import UnsupportedFormat, format_of
from quantkit.models import lazy
from quantkit.models.loading import ModelLoadError, read_config_json, transformers_config
from quantkit.models.registry import ArchSpec, spec_for_config
from quantkit.nn.fp8_linear import Fp8Linear
from quantkit.nn.quant_linear import QuantLinear

# Our fused linears and the checkpoint linears they are made of, in output order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Checkpoint tensors the decoder has no use for: rotary tables some checkpoints save, vLLM's fp8 KV scales.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.k_scale|\.v_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Checkpoint:
    directory: Path
    config: Any  # transformers config (Llama layout; no quantization_config)
    reader: Any  # names() and read(names) → {name: tensor}
    convert: Optional[Callable[[dict], dict]] = None  # to the target layout's names (a converted family)
    layer_pattern: Optional["re.Pattern[str]"] = None  # block index of a source tensor name
    spec: Optional[ArchSpec] = None
    format: Optional[WeightFormat] = None  # the packed-weight format of a quantkit export
    layout: Optional[WeightLayout] = None  # and the layout its quantization_config records


def open_checkpoint(path: Path) -> Checkpoint:
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist: pass a Hugging Face model directory or a quantkit export")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a model directory: the engine runs a Hugging Face directory or a "
                             "quantkit export (quantize a .gguf file first, or use quantkit.load)")
    cfg = read_config_json(path)
    spec = spec_for_config(cfg)  # an unsupported architecture fails here, with the list of supported ones
    conversion, quant = spec.conversion, cfg.get("quantization_config")
    if quant and conversion is not None and conversion.export_layout is None:
        raise ModelLoadError(f"{path}: a quantized {spec.name} checkpoint in its original layout is not "
                             "supported; quantize the full-precision one with quantkit (its export is converted)")
    try:
        fmt = format_of(quant) if quant else None
    except UnsupportedFormat as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    layout = fmt.read_layout(quant) if fmt else None
    if conversion is not None:  # InternLM2, ...: run in another family's layout, converted per block
        # A family exported in its source layout (LLaVA) converts by renaming: its packed tensors read alike.
        return Checkpoint(path, conversion.config(cfg), lazy.TensorReader(path, skip=(KV_STATS_AT_ROOT,)),
                          convert=lambda sd: conversion.state_dict(sd, cfg),
                          layer_pattern=_layer_pattern(conversion.source_layers_path), spec=spec,
                          format=fmt, layout=layout)
    config = transformers_config(path)
    try:
        reader = lazy.TensorReader(path, skip=(KV_STATS_AT_ROOT,))
    except lazy.WeightsMismatch as exc:
        raise ModelLoadError(str(exc)) from None
    return Checkpoint(path, config, reader, layer_pattern=_LAYER, spec=spec, format=fmt, layout=layout)


def _layer_pattern(layers_path: str) -> "re.Pattern[str]":
    return re.compile(rf"^{re.escape(layers_path)}\.(\d+)\.")


def generation_config(ckpt: Checkpoint):
    from transformers import GenerationConfig

    if (ckpt.directory / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(str(ckpt.directory))
    else:
        gen = GenerationConfig.from_model_config(ckpt.config)
    conversion = ckpt.spec.conversion if ckpt.spec is not None else None
    if conversion is not None and conversion.generation is not None:
        gen = conversion.generation(gen, ckpt.directory)
    return gen


def quant_linear(parts: list[dict[str, torch.Tensor]], fmt: WeightFormat, layout: WeightLayout,
                 dtype: torch.dtype) -> QuantLinear | Fp8Linear:
    """One QuantLinear (Fp8Linear for FP8) from the checkpoint tensors of linears sharing their input (a bias
    among them), outputs in order; its packed tensors are the checkpoint's, joined by the format where there
    are several."""
    biases = [p.get("bias") for p in parts]
    tensors = fmt.join([{n: t for n, t in p.items() if n != "bias"} for p in parts], layout)
    args = fmt.linear_args(tensors, layout)
    cls = Fp8Linear if args["layout"] == Fp8Linear.LAYOUT else QuantLinear
    layer = cls(**args, bias=biases[0] is not None, device="meta")
    if biases[0] is not None:
        tensors["bias"] = torch.cat(biases).to(dtype)
    for name, t in tensors.items():
        setattr(layer, name, t)
    # On the CPU the reference path dequantizes on every call; keeping the result trades memory for speed.
    layer.cache_dequantized = next(iter(tensors.values())).device.type == "cpu"
    return layer


def _fuse_fp(parts: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> nn.Linear:
    weight = torch.cat([p["weight"] for p in parts], dim=0).to(dtype)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].get("bias") is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(torch.cat([p["bias"] for p in parts]).to(dtype), requires_grad=False)
    return layer


def _take(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove and return the tensors named `prefix.<name>`, keyed by <name>."""
    found = {n[len(prefix) + 1:]: n for n in tensors if n.startswith(prefix + ".") and "." not in n[len(prefix) + 1:]}
    return {short: tensors.pop(full) for short, full in found.items()}


def _load_linear(parent: nn.Module, child: str, full_name: str, tensors: dict, ckpt: Checkpoint, dtype) -> None:
    base = full_name.rpartition(".")[0]
    sources = [f"{base}.{s}" if base else s for s in FUSED.get(child, (child,))]
    # A checkpoint that stores the fused linear itself (Glm's gate_up_proj) is read as one part.
    whole = _take(tensors, full_name) if child in FUSED else {}
    if whole:
        sources = [full_name]
    parts = [whole] if whole else [_take(tensors, s) for s in sources]
    where = ckpt.directory
    missing = [s for s, p in zip(sources, parts) if not p]
    if missing:
        raise ModelLoadError(f"{where}: the checkpoint has no tensors for {missing[0]} (is it a complete checkpoint?)")
    kinds = {ckpt.format is not None and ckpt.format.holds(p) for p in parts}
    if len(kinds) > 1:
        raise ModelLoadError(f"{where}: {', '.join(sources)} are not all quantized alike; the engine runs them as "
                             "one layer: quantize all of them or none")
    layer = quant_linear(parts, ckpt.format, ckpt.layout, dtype) if kinds.pop() else _fuse_fp(parts, dtype)
    old = getattr(parent, child)
    if (layer.in_features, layer.out_features) != (old.in_features, old.out_features):
        raise ModelLoadError(f"{where}: {', '.join(sources)} map {layer.in_features} → {layer.out_features} features, "
                             f"the config says {old.in_features} → {old.out_features}")
    setattr(parent, child, layer)


def _load_module_tensors(model: nn.Module, names: list[str], tensors: dict, ckpt: Checkpoint, device, dtype) -> None:
    """Fill the modules `names` (ours, HF-style paths) from `tensors` (checkpoint names, on `device`)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if isinstance(module, nn.Linear):
            _load_linear(parent, child, name, tensors, ckpt, dtype)
            continue
        own = _take(tensors, name)
        for pname, _ in list(module.named_parameters(recurse=False)):
            if pname not in own:
                raise ModelLoadError(f"{ckpt.directory}: the checkpoint has no tensor {name}.{pname}")
            t = own.pop(pname)
            if tuple(t.shape) != tuple(getattr(module, pname).shape):
                raise ModelLoadError(f"{ckpt.directory}: {name}.{pname} has shape {tuple(t.shape)}, the config says "
                                     f"{tuple(getattr(module, pname).shape)}")
            setattr(module, pname, nn.Parameter(t.to(dtype), requires_grad=False))


def _leaf_modules(model: nn.Module, prefix: str) -> list[str]:
    """Modules under `prefix` that own checkpoint tensors (linears, norms, the embedding)."""
    out = []
    for name, module in model.named_modules():
        if not name.startswith(prefix) or "rotary" in name:
            continue
        if isinstance(module, nn.Linear) or list(module.parameters(recurse=False)):
            out.append(name)
    return out


def load_weights(model: nn.Module, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
    """Read the checkpoint into `model` (built on the meta device), one decoder layer at a time."""
    names = [n for n in ckpt.reader.names() if not _IGNORED.search(n)]
    by_layer: dict[int, list[str]] = {}
    rest: list[str] = []
    for n in names:
        m = (ckpt.layer_pattern or _LAYER).match(n)
        (by_layer.setdefault(int(m.group(1)), []) if m else rest).append(n)
    if set(by_layer) != set(range(model.num_layers)):
        raise ModelLoadError(f"{ckpt.directory}: the checkpoint has {len(by_layer)} decoder layers, its config "
                             f"{model.num_layers}")

    def read(unit_names: list[str]) -> dict[str, torch.Tensor]:
        tensors = ckpt.reader.read(unit_names)
        if ckpt.convert is not None:
            tensors = ckpt.convert(tensors)
        return {n: t.to(device) for n, t in tensors.items()}

    for i in range(model.num_layers):
        tensors = read(by_layer[i])
        _load_module_tensors(model, _leaf_modules(model, f"model.layers.{i}."), tensors, ckpt, device, dtype)
        _check_all_used(tensors, ckpt.directory)
    tensors = read(rest)
    top = ["model.embed_tokens", "model.norm"]
    if model.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some checkpoints save the tied copy too
    else:
        top.append("lm_head")
    _load_module_tensors(model, top, tensors, ckpt, device, dtype)
    _check_all_used(tensors, ckpt.directory)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # the ops in front of FP8 linears quantize for them (layers.feeds_fp8)
        if hasattr(module, "link_fp8_inputs"):
            module.link_fp8_inputs()


def _check_all_used(tensors: dict, where: Path) -> None:
    if tensors:
        extra = sorted(tensors)
        raise ModelLoadError(f"{where}: tensors the config does not describe: {', '.join(extra[:3])}"
                             f"{' …' if len(extra) > 3 else ''}")
