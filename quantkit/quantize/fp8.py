"""FP8 (e4m3) W8A8 by plain rounding, block by block, as llm-compressor's FP8_DYNAMIC and FP8 schemes do.

Weights: scale = absmax / 448 per output channel (or per tensor), W / scale rounded to the nearest e4m3
value. Activations: "dynamic" needs nothing here (they are quantized per token at run time); "static"
measures each linear's largest |input| over the calibration windows, and its input scale is that / 448.
The statistics are taken on the blocks as served, their weights already FP8 (the inputs of block i are
the outputs of the quantized blocks before it); the activations themselves are left unrounded there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import QuantizeConfig
from quantkit.models.lazy import BlockWeights
from quantkit.models.registry import ArchSpec
from quantkit.packing import E4M3_MAX, FP8_MIN_SCALE, dequantize_fp8, encode_e4m3
from quantkit.quantize.awq import activation_dtype, resolve_device
from quantkit.quantize.calibration import BlockInputs, call_layer, capture_inputs
from quantkit.quantize.primitives import QuantizedWeight
from quantkit.quantize.rtn import QuantizedBlock, decoder_layers



@dataclass
class Fp8Weight(QuantizedWeight):
    """An e4m3 weight `q` [out, in] with fp32 `scales` [out, 1] (per channel) or [1] (per tensor); no zeros.
    `input_scale` [1] is the static activation scale, where measured."""

    input_scale: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.q, self.scales)


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
def fp8_blocks(model: torch.nn.Module, spec: ArchSpec, config: QuantizeConfig, windows: Optional[torch.Tensor],
               report: dict[str, Any], blocks: Optional[BlockWeights] = None, progress: bool = True,
               ) -> Iterator[QuantizedBlock]:
    """FP8-quantize `model`'s blocks one at a time on the pass's device, yielding each as `rtn_blocks` does
    (its linears holding their dequantized weights; `qweights` are `Fp8Weight`s). The static scheme needs
    `windows` [n, seqlen]; its input scales go into the yielded weights. Settings go into `report["fp8"]`."""
    fp8 = config.fp8
    static = fp8.scheme == "static"
    if static and windows is None:
        raise ValueError("static FP8 needs calibration windows")
    blocks = blocks or BlockWeights()
    device = resolve_device(config.device)
    dtype = activation_dtype(device)
    info: dict[str, Any] = {"scheme": fp8.scheme, "weight_strategy": fp8.weight_strategy, "device": str(device),
                            "activations": "per token at run time" if not static else "per tensor, calibrated"}
    if static:
        info["calibration_tokens"] = int(windows.numel())
        info["input_scales"] = {}
    report["fp8"] = info
    inputs = capture_inputs(model, spec, windows, config.calib.batch_size, device, dtype) if static else None
    names = tuple(spec.linears)
    bar = tqdm(decoder_layers(model, spec), desc=f"FP8 {fp8.scheme}", disable=not progress, unit="block")
    for index, layer in enumerate(bar):
        prefix = f"{spec.layers_path}.{index}"
        blocks.load(index, layer)
        store_dtype = next(layer.parameters()).dtype
        layer.to(device=device)
        qweights: dict[str, Fp8Weight] = {}
        for name in names:
            lin = layer.get_submodule(name)
            qw = quantize_fp8_weight(lin.weight.data, fp8.weight_strategy)
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            qweights[f"{prefix}.{name}"] = qw
        layer.to(dtype=dtype)
        if static:
            for name, scale in _static_scales(layer, names, inputs, index).items():
                qweights[f"{prefix}.{name}"].input_scale = scale
                info["input_scales"][f"{prefix}.{name}"] = scale.item()
        yield QuantizedBlock(index, prefix, layer, qweights)
        del qweights
        blocks.release(index, layer, store_dtype)
