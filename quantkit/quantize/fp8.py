"""FP8 (e4m3) W8A8, block by block, as llm-compressor's FP8_DYNAMIC and FP8 schemes lay it out.

Weights: scale = absmax / 448 per output channel (or per tensor), then W / scale onto the e4m3 grid, either
to the nearest value (llm-compressor's rounding; no data) or by GPTQ's error feedback (rounding.py): each
column's rounding error is fed to the columns not yet rounded through the inverse Gram matrix of the
linear's inputs on calibration text, with the guard that a linear keeps the nearest values where that
gives the smaller output error Σ δᵀHδ. The scales, and so the checkpoint layout, are the same either way.
Activations: "dynamic" needs nothing here (they are quantized per token at run time); "static"
measures each linear's largest |input| over the calibration windows, and its input scale is that / 448.
Statistics are taken on the blocks as served, their weights already FP8 (the inputs of block i are the
outputs of the quantized blocks before it); the Gram matrices of block i on those inputs through its
unquantized weights. The activations themselves are left unrounded there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import QuantizeConfig
from quantkit.models.lazy import BlockWeights
from quantkit.models.registry import ArchSpec
from quantkit.packing import E4M3_MAX, FP8_MIN_SCALE, dequantize_fp8, encode_e4m3
from quantkit.quantize.awq import activation_dtype, input_sets, resolve_device
from quantkit.quantize.calibration import BlockInputs, InputStats, call_layer, capture_inputs, gather_block
from quantkit.quantize.finalize import error_feedback
from quantkit.quantize.primitives import QuantizedWeight
from quantkit.quantize.rounding import E4M3_GRID
from quantkit.quantize.rtn import QuantizedBlock, decoder_layers



@dataclass
class Fp8Weight(QuantizedWeight):
    """An e4m3 weight `q` [out, in] with fp32 `scales` [out, 1] (per channel) or [1] (per tensor); no zeros.
    `input_scale` [1] is the static activation scale, where measured."""

    input_scale: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.q, self.scales)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, str]:
        rows = self.scales.float().reshape(-1, 1).expand(self.q.shape[0], 1)
        return rows, torch.zeros_like(rows), E4M3_GRID

    def with_codes(self, codes: torch.Tensor) -> "Fp8Weight":
        return replace(self, q=codes.to(torch.float8_e4m3fn))


def weight_scale(w: torch.Tensor, strategy: str) -> torch.Tensor:
    """absmax / 448 of W [out, in], float32: [out, 1] per channel, [1] per tensor."""
    absmax = w.float().abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.float().abs().amax().reshape(1)
    return (absmax / E4M3_MAX).clamp_min(FP8_MIN_SCALE)


def quantize_fp8_weight(w: torch.Tensor, strategy: str) -> Fp8Weight:
    """W [out, in] rounded onto the e4m3 grid under its absmax scale (per channel or per tensor)."""
    scale = weight_scale(w, strategy)
    q = encode_e4m3(w, scale.reshape(-1, 1) if scale.numel() > 1 else scale)
    return Fp8Weight(q=q, zeros=None, scales=scale, bits=8, group_size=w.shape[1])


class _InputAbsmax:
    """Forward pre-hooks on a block's linears: the largest |input| each has seen."""

    def __init__(self, layer: torch.nn.Module, names: tuple[str, ...]) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.handles = [layer.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def hook(module, args):
            m = args[0].detach().abs().amax().float()
            self.absmax[name] = torch.maximum(self.absmax[name], m) if name in self.absmax else m
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _static_scales(layer: torch.nn.Module, names: tuple[str, ...], inputs: BlockInputs, index: int) -> dict[str, torch.Tensor]:
    """One forward of the (quantized) block over every batch: each linear's input scale [1]; the batch's
    inputs are replaced by the block's outputs, the next block's inputs."""
    observer = _InputAbsmax(layer, names)
    try:
        for j, (hidden, kwargs) in enumerate(inputs.batches(index)):
            inputs.hidden[j] = call_layer(layer, hidden, kwargs)
    finally:
        observer.remove()
    missing = [n for n in names if n not in observer.absmax]
    if missing:
        raise RuntimeError(f"block {index}: {', '.join(missing)} saw no input during calibration")
    return {n: (observer.absmax[n] / E4M3_MAX).clamp_min(FP8_MIN_SCALE).reshape(1) for n in names}


@torch.no_grad()
def _input_grams(layer: torch.nn.Module, spec: ArchSpec, inputs: BlockInputs, index: int,
                 ) -> dict[tuple[str, ...], InputStats]:
    """One forward of the unquantized block over every batch: Σ x xᵀ per set of linears sharing an input."""
    stats = {}
    for names in input_sets(spec):
        n = layer.get_submodule(names[0]).in_features
        stats[names] = InputStats.empty(n, n, next(layer.parameters()).device, "full")
    gather_block(layer, inputs, index, stats, [], 0, contextlib.nullcontext, keep_outputs=False)
    return stats


@torch.no_grad()
def _quantize_block(layer: torch.nn.Module, spec: ArchSpec, strategy: str,
                    grams: Optional[dict[tuple[str, ...], InputStats]]) -> tuple[dict[str, Fp8Weight], dict[str, Any]]:
    """Every linear of the block onto e4m3 (nearest, or error feedback where `grams` are given and it lowers
    the linear's output error); the linears keep the dequantized weights. Returns the weights by name in the
    block and, with `grams`, the output errors Σ δᵀHδ of both roundings."""
    out: dict[str, Fp8Weight] = {}
    errors = {"nearest": 0.0, "gptq": 0.0, "kept": 0, "fallbacks": []}
    for names in input_sets(spec):
        ws = [layer.get_submodule(n).weight.data.float() for n in names]
        qws = [quantize_fp8_weight(w, strategy) for w in ws]
        stats = None if grams is None else grams[names]
        if stats is not None and stats.full and not stats.nonfinite:
            entries: list[dict[str, Any]] = [{} for _ in names]
            qws = error_feedback(ws, qws, stats, entries)
            for name, e in zip(names, entries):
                if "fallback" in e:
                    errors["fallbacks"].append(f"{name}: {e['fallback']}")
                    continue
                errors["nearest"] += e["out_err_nearest"]
                errors["gptq"] += min(e["out_err_gptq"], e["out_err_nearest"])
                errors["kept"] += e["out_err_gptq"] < e["out_err_nearest"]
        elif stats is not None:
            errors["fallbacks"].append(f"{', '.join(names)}: non-finite inputs: nearest rounding")
        for name, qw in zip(names, qws):
            lin = layer.get_submodule(name)
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            out[name] = qw
    return out, errors


@torch.no_grad()
def _propagate(layer: torch.nn.Module, inputs: BlockInputs, index: int) -> None:
    """The next block's inputs: this (quantized) block's outputs, batch by batch in place."""
    for j, (hidden, kwargs) in enumerate(inputs.batches(index)):
        inputs.hidden[j] = call_layer(layer, hidden, kwargs)


@torch.no_grad()
def fp8_blocks(model: torch.nn.Module, spec: ArchSpec, config: QuantizeConfig, windows: Optional[torch.Tensor],
               report: dict[str, Any], blocks: Optional[BlockWeights] = None, progress: bool = True,
               ) -> Iterator[QuantizedBlock]:
    """FP8-quantize `model`'s blocks one at a time on the pass's device, yielding each as `rtn_blocks` does
    (its linears holding their dequantized weights; `qweights` are `Fp8Weight`s). The static scheme and GPTQ
    rounding need `windows` [n, seqlen]; static input scales go into the yielded weights. Settings (and GPTQ's
    output errors) go into `report["fp8"]`."""
    fp8 = config.fp8
    static, gptq = fp8.scheme == "static", fp8.rounding == "gptq"
    if (static or gptq) and windows is None:
        raise ValueError(f"{'static FP8' if static else 'GPTQ rounding'} needs calibration windows")
    blocks = blocks or BlockWeights()
    device = resolve_device(config.device)
    dtype = activation_dtype(device)
    info: dict[str, Any] = {"scheme": fp8.scheme, "weight_strategy": fp8.weight_strategy, "rounding": fp8.rounding,
                            "device": str(device),
                            "activations": "per token at run time" if not static else "per tensor, calibrated"}
    if static or gptq:
        info["calibration_tokens"] = int(windows.numel())
    if static:
        info["input_scales"] = {}
    if gptq:
        info["output_error"] = {"nearest": 0.0, "gptq": 0.0, "kept": 0, "linears": 0}
        info["fallbacks"] = []
    report["fp8"] = info
    inputs = capture_inputs(model, spec, windows, config.calib.batch_size, device, dtype) if static or gptq else None
    names = tuple(spec.linears)
    layers = decoder_layers(model, spec)
    bar = tqdm(layers, desc=f"FP8 {fp8.scheme}", disable=not progress, unit="block")
    for index, layer in enumerate(bar):
        prefix = f"{spec.layers_path}.{index}"
        blocks.load(index, layer)
        store_dtype = next(layer.parameters()).dtype
        layer.to(device=device)
        grams = None
        if gptq:
            layer.to(dtype=dtype)
            grams = _input_grams(layer, spec, inputs, index)
        quantized, errors = _quantize_block(layer, spec, fp8.weight_strategy, grams)
        del grams
        if gptq:
            total = info["output_error"]
            for key in ("nearest", "gptq", "kept"):
                total[key] += errors[key]
            total["linears"] += len(names)
            info["fallbacks"] += [f"{prefix}.{f}" for f in errors["fallbacks"]]
            bar.set_postfix(out_err=f"{errors['nearest']:.3g}→{errors['gptq']:.3g}")
        qweights = {f"{prefix}.{name}": quantized[name] for name in names}
        layer.to(dtype=dtype)
        if static:
            for name, scale in _static_scales(layer, names, inputs, index).items():
                qweights[f"{prefix}.{name}"].input_scale = scale
                info["input_scales"][f"{prefix}.{name}"] = scale.item()
        elif gptq and index + 1 < len(layers):  # the last block's outputs feed nothing quantized
            _propagate(layer, inputs, index)
        yield QuantizedBlock(index, prefix, layer, qweights)
        del qweights
        blocks.release(index, layer, store_dtype)
