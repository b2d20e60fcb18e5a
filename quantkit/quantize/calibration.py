"""The calibration driver's plumbing: capture the first block's inputs, run blocks, gather statistics.

The model stays where it was loaded (the CPU, fp16). `capture_inputs` runs it once with every decoder
layer replaced by a stand-in that records what the layer would have received (hidden states and the
keyword arguments the model builds for it: rotary embeddings, masks) and passes the hidden states
through, so the embedding, mask and rotary code of any family is reused as is and no layer or head
is computed. The last stand-in stops the forward, so the lm_head never runs on the calibration set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from quantkit.models.registry import ArchSpec
from quantkit.quantize.rtn import decoder_layers

Kwargs = dict[str, Any]


class _StopForward(Exception):
    """Raised by the last stand-in layer: everything needed has been recorded."""


class _Recorder(torch.nn.Module):
    """Stands in for a decoder layer: records its call and returns the hidden states unchanged."""

    def __init__(self, layer: torch.nn.Module, calls: list, last: bool) -> None:
        super().__init__()
        self.layer = layer
        self.calls = calls
        self.last = last

    def __getattr__(self, name: str) -> Any:
        # Families read attributes of their layers while looping (e.g. `attention_type` for masks).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.layer, name)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:  # positional extras are not used by the supported families; keep them anyway
            kwargs["_args"] = args
        self.calls.append((hidden_states, kwargs))
        if self.last:
            raise _StopForward
        return hidden_states


def _to(value: Any, device: torch.device, dtype: Optional[torch.dtype]) -> Any:
    """Move tensors (also inside tuples/lists/dicts) to `device`; floating ones to `dtype` if given."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


@dataclass
class BlockInputs:
    """Per calibration batch: the hidden states entering the current block, and per layer its kwargs."""

    hidden: list[torch.Tensor]
    layer_kwargs: list[list[Kwargs]]  # [layer][batch]

    def batches(self, layer_index: int) -> Iterator[tuple[torch.Tensor, Kwargs]]:
        yield from zip(self.hidden, self.layer_kwargs[layer_index])


def _cache_off(kwargs: Kwargs) -> Kwargs:
    for key in ("past_key_values", "past_key_value", "cache"):
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


@torch.no_grad()
def capture_inputs(
    model: torch.nn.Module, spec: ArchSpec, windows: torch.Tensor, batch_size: int,
    device: torch.device, dtype: torch.dtype,
) -> BlockInputs:
    """Run the model's stem on `windows` [n, seqlen] and record every layer's inputs per batch.

    Hidden states and kwargs are moved to `device` and floating tensors cast to `dtype`; kwargs that
    are the same object for several layers (the usual case) are moved once and shared.
    """
    layers = decoder_layers(model, spec)
    originals = list(layers)
    calls: list[list] = [[] for _ in originals]
    for i, layer in enumerate(originals):
        layers[i] = _Recorder(layer, calls[i], last=i == len(originals) - 1)
    model_device = next(model.parameters()).device
    try:
        for start in range(0, windows.shape[0], batch_size):
            ids = windows[start : start + batch_size].to(model_device)
            try:
                model(input_ids=ids, use_cache=False)
            except _StopForward:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    hidden = [h.to(device=device, dtype=dtype) for h, _ in calls[0]]
    moved: dict[int, Any] = {}  # id of a recorded value → its moved copy, so shared objects stay shared
    layer_kwargs: list[list[Kwargs]] = []
    for per_layer in calls:
        out = []
        for _, kwargs in per_layer:
            kw = {}
            for key, value in kwargs.items():
                if id(value) not in moved:
                    moved[id(value)] = _to(value, device, dtype)
                kw[key] = moved[id(value)]
            out.append(_cache_off(kw))
        layer_kwargs.append(out)
    return BlockInputs(hidden, layer_kwargs)


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: Kwargs) -> torch.Tensor:
    """One decoder layer's output hidden states (layers return a tensor or a tuple, by version)."""
    kw = dict(kwargs)
    args = kw.pop("_args", ())
    out = layer(hidden, *args, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


def call_module(module: torch.nn.Module, args: tuple, kwargs: Kwargs) -> torch.Tensor:
    """A loss module's main output (attention modules return (output, weights))."""
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class InputStats:
    """What a set of linears sharing one input saw over the calibration set.

    `abs_sum`/`count`: per-channel mean |x| (the AWQ statistic). `cov`: per quantization group the
    Gram matrix Σ x_g x_gᵀ [groups, gs, gs], from which the clip search gets the exact per-group
    output error over every token without keeping the tokens.
    """

    abs_sum: torch.Tensor
    count: int = 0
    cov: Optional[torch.Tensor] = None
    group_size: int = 0
    nonfinite: bool = False

    @classmethod
    def empty(cls, in_features: int, group_size: int, device: torch.device, with_cov: bool) -> "InputStats":
        cov = None
        if with_cov:
            groups = in_features // group_size
            cov = torch.zeros(groups, group_size, group_size, device=device, dtype=torch.float32)
        return cls(torch.zeros(in_features, device=device, dtype=torch.float32), 0, cov, group_size)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if not torch.isfinite(x).all():
            # The guard: a set that saw NaN/Inf gets no scaling and no clipping (plain RTN).
            self.nonfinite = True
            return
        self.abs_sum += x.abs().sum(0)
        self.count += x.shape[0]
        if self.cov is not None:
            g = x.reshape(x.shape[0], -1, self.group_size).transpose(0, 1)  # [groups, tokens, gs]
            self.cov.baddbmm_(g.transpose(1, 2), g)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


@dataclass
class Captured:
    """Inputs of a group's loss module on the search batches: positional args and kwargs per batch."""

    calls: list[tuple[tuple, Kwargs]] = field(default_factory=list)
