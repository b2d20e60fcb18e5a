"""The calibration driver's plumbing: capture the first block's inputs, run blocks, gather statistics.

The model stays where it was loaded (the CPU, fp16). `capture_inputs` runs it once with every decoder
layer replaced by a stand-in that records what the layer would have received (hidden states and the
keyword arguments the model builds for it: rotary embeddings, masks) and passes the hidden states
through, so the embedding, mask and rotary code of any family is reused as is and no layer or head
is computed. The last stand-in stops the forward, so the lm_head never runs on the calibration set.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    `abs_sum`/`count`: per-channel mean |x| (the AWQ statistic). `gram`: Σ x xᵀ, either per
    quantization group [groups, gs, gs] (enough for the clip search, which gets the exact per-group
    output error over every token from it without keeping the tokens) or whole [in, in] (for
    error-feedback rounding).
    """

    abs_sum: torch.Tensor
    count: int = 0
    gram: Optional[torch.Tensor] = None
    group_size: int = 0
    full: bool = False
    nonfinite: bool = False

    @classmethod
    def empty(cls, in_features: int, group_size: int, device: torch.device, gram: Optional[str]) -> "InputStats":
        """`gram` is None, "groups" or "full"."""
        g = None
        if gram == "full":
            g = torch.zeros(in_features, in_features, device=device, dtype=torch.float32)
        elif gram == "groups":
            g = torch.zeros(in_features // group_size, group_size, group_size, device=device, dtype=torch.float32)
        return cls(torch.zeros(in_features, device=device, dtype=torch.float32), 0, g, group_size, gram == "full")

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        abs_sum = x.abs().sum(0)  # non-finite exactly where x has NaN/Inf (finite inputs cannot reach 3e38)
        if not torch.isfinite(abs_sum).all():
            # The guard: a set that saw NaN/Inf gets no scaling and no clipping (plain RTN).
            self.nonfinite = True
            return
        self.abs_sum += abs_sum
        self.count += x.shape[0]
        if self.gram is None:
            return
        # fp32 products: bf16-rounded Gram matrices stop being positive definite (seen on SmolLM2).
        if self.full:
            self.gram.addmm_(x.t(), x)
        else:
            g = x.reshape(x.shape[0], -1, self.group_size).transpose(0, 1)  # [groups, tokens, gs]
            self.gram.baddbmm_(g.transpose(1, 2), g)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)

    def group_gram(self) -> Optional[torch.Tensor]:
        """Σ x_g x_gᵀ per quantization group, [groups, gs, gs]."""
        if self.gram is None or not self.full:
            return self.gram
        n, gs = self.gram.shape[0], self.group_size
        return self.gram.reshape(n // gs, gs, n // gs, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)

    def rescale(self, columns: torch.Tensor) -> None:
        """The input became x / `columns` (scales folded into the linears): update the statistics."""
        inv = 1.0 / columns.to(self.abs_sum.device).float()
        self.abs_sum *= inv
        if self.gram is not None and self.full:
            self.gram *= inv.unsqueeze(1) * inv.unsqueeze(0)
        elif self.gram is not None:
            inv = inv.reshape(self.gram.shape[0], -1)
            self.gram *= inv.unsqueeze(2) * inv.unsqueeze(1)


@torch.no_grad()
def gather_block(
    layer: torch.nn.Module, inputs: BlockInputs, index: int, stats: dict[tuple[str, ...], InputStats],
    loss_modules: list[str], n_search: int, fwd, keep_outputs: bool,
) -> tuple[list[torch.Tensor], list[list[tuple[tuple, Kwargs]]]]:
    """One fp forward of the block over every batch, with hooks.

    Fills `stats` (keyed by the linears sharing an input; the first one's input is recorded) and
    returns the block's outputs (if `keep_outputs`) and, per entry of `loss_modules`, the calls
    (args, kwargs) it received on the first `n_search` windows: the search replays them.
    """
    captured: list[list] = [[] for _ in loss_modules]
    state = {"search": False}

    def stat_hook(names):
        def hook(_module, args):
            with torch.autocast(args[0].device.type, enabled=False):  # statistics in fp32
                stats[names].add(args[0])
        return hook

    def capture_hook(i):
        def hook(_module, args, kwargs):
            if state["search"]:
                captured[i].append((args, kwargs))
        return hook

    handles = [layer.get_submodule(names[0]).register_forward_pre_hook(stat_hook(names)) for names in stats]
    handles += [layer.get_submodule(name).register_forward_pre_hook(capture_hook(i), with_kwargs=True)
                for i, name in enumerate(loss_modules)]
    outputs = []
    try:
        seen = 0
        for hidden, kwargs in inputs.batches(index):
            state["search"] = seen < n_search
            with fwd():
                out = call_layer(layer, hidden, kwargs)
            if keep_outputs:
                outputs.append(out)
            seen += hidden.shape[0]
    finally:
        for h in handles:
            h.remove()
    return outputs, captured
