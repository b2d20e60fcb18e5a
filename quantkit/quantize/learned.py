"""Learned rounding and clipping per block (after AutoRound, Cheng et al. 2023, and OmniQuant's learnable clip).

Once a block's scales (and AWQ's smoothing) are fixed and its codes chosen (error feedback or nearest),
every quantized linear gets a rounding offset V ∈ [−½, ½] per weight and a clip factor r ∈ [½, 1] per
group, the share of the group's range that is kept. They are learned so that the block's output on
the calibration windows matches the unquantized block's output on the same inputs: signed gradient
descent (each step moves a value by lr · sign(gradient), lr decaying linearly to 0), the rounding
passed through by a straight-through estimator. The result is ordinary integer codes, fp16 scales and
integer zeros, kept only when it lowers the block's output error over every calibration window;
otherwise the start codes stay. `LearnedWeight` says how the start codes are reproduced and why the
clip keeps each code's place on the grid.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch.func import functional_call

from quantkit.config import LearnConfig, QuantizeConfig
from quantkit.quantize.calibration import Kwargs
from quantkit.quantize.primitives import QuantizedWeight

MIN_CLIP = 0.5
# How close to a rounding boundary a start code's anchor may lie (in grid steps): strictly inside, so
# that V = 0 rounds back to the start code.
EDGE = 0.5 - 1e-3

Batch = tuple[torch.Tensor, Kwargs]


def start_config(config: QuantizeConfig) -> QuantizeConfig:
    """The config whose rounding gives the codes learning starts from: AWQ's error-feedback codes (with
    its clip search), or for RTN the nearest codes of the plain ranges."""
    changes = {"rounding": "gptq"} if config.method == "awq" else {"rounding": "nearest", "clip": False}
    # Only the `awq` part changes; the rest was validated when `config` was made (and an in-memory pass
    # may hold bits that no format writes, which building a config anew would refuse).
    start = copy.copy(config)
    object.__setattr__(start, "awq", dataclasses.replace(config.awq, **changes))
    return start


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (torch.round(x) - x).detach()


class LearnedWeight:
    """One linear's learnable rounding under its start scales s₀ and zeros z₀ ([out, groups]).

    In steps of s₀ every weight has an anchor: the value its start code is the nearest code of (W/s₀,
    or for error-feedback codes W with the earlier columns' errors fed back, divided by s₀), kept
    inside that code's rounding interval; the code is clamp(round(anchor + V) + z₀, 0, qmax). The clip
    factor r shrinks the group's range [−z₀s₀, (qmax − z₀)s₀] to r times itself: scale s₀·r, zero z₀,
    so each code keeps its place on the grid and the gradient in r is exact. (Re-rounding every weight
    to the grid of a new range, as AutoRound's clip does, undoes the error-feedback codes' choices at
    every step; measured on SmolLM2 and tiny models it lowered the block error less, or raised it.)
    At V = 0, r = 1 these are the start codes, zeros and scales exactly.
    """

    def __init__(self, rounded: torch.Tensor, start: QuantizedWeight) -> None:
        out_f, in_f = rounded.shape
        self.shape, self.bits, self.group_size = rounded.shape, start.bits, start.group_size
        self.code_dtype = start.q.dtype
        self.qmax = 2**start.bits - 1
        groups = in_f // start.group_size
        self.s0 = start.scales.float().reshape(out_f, groups, 1)
        self.z0 = start.zeros.reshape(out_f, groups, 1)
        c0 = start.q.float().reshape(out_f, groups, -1) - self.z0
        u = torch.nan_to_num(rounded.float().reshape(out_f, groups, -1) / self.s0)
        self.anchor = c0 + (u - c0).clamp(-EDGE, EDGE)
        self.offset = torch.zeros_like(self.anchor, requires_grad=True)
        self.clip = torch.ones_like(self.s0, requires_grad=True)

    def parameters(self) -> list[torch.Tensor]:
        return [self.offset, self.clip]

    def _codes(self, rounding) -> torch.Tensor:
        return (rounding(self.anchor + self.offset) + self.z0).clamp(0, self.qmax)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] the current offsets and clip factors give, differentiable in both."""
        return ((self._codes(_round_ste) - self.z0) * (self.s0 * self.clip)).reshape(self.shape)

    @torch.no_grad()
    def project(self) -> None:
        """Back into the allowed ranges after a step."""
        self.offset.clamp_(-0.5, 0.5)
        self.clip.clamp_(MIN_CLIP, 1.0)

    @torch.no_grad()
    def export(self) -> QuantizedWeight:
        """Codes, zeros and scales as the checkpoint stores them (scales rounded to fp16)."""
        scale = (self.s0 * self.clip).half().float().clamp(min=torch.finfo(torch.float16).tiny)
        return QuantizedWeight(self._codes(torch.round).reshape(self.shape).to(self.code_dtype),
                               self.z0.squeeze(-1).to(torch.int32), scale.squeeze(-1), self.bits, self.group_size)


def call_block(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: Kwargs,
               weights: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """The block's output hidden states, with `weights` ({parameter name: tensor}) in place of its own."""
    kw = dict(kwargs)
    args = kw.pop("_args", ())
    out = functional_call(layer, weights or {}, (hidden, *args), kw)
    return out[0] if isinstance(out, (tuple, list)) else out


def _rows(value: Any, rows: slice, n: int) -> Any:
    """`value` (a kwarg of a batch of n windows) restricted to `rows`: tensors whose first dimension is
    the batch are sliced, tensors shared by the batch (size 1, or no batch dimension) kept whole."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() and value.shape[0] == n and n > 1 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, rows, n) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, n) for k, v in value.items()}
    return value


def _minibatches(batches: list[Batch], targets: list[torch.Tensor], size: int, steps: int,
                 generator: torch.Generator) -> Iterator[tuple[torch.Tensor, Kwargs, torch.Tensor]]:
    """`steps` minibatches of up to `size` windows, each from one forward batch, in an order drawn from
    `generator` anew for every pass over the windows."""
    slots = [(j, slice(k, min(k + size, h.shape[0]))) for j, (h, _) in enumerate(batches)
             for k in range(0, h.shape[0], size)]
    done = 0
    while done < steps:
        for i in torch.randperm(len(slots), generator=generator).tolist()[: steps - done]:
            j, rows = slots[i]
            (hidden, kwargs), n = batches[j], batches[j][0].shape[0]
            yield hidden[rows], _rows(kwargs, rows, n), targets[j][rows]
            done += 1


@torch.no_grad()
def block_error(layer: torch.nn.Module, batches: list[Batch], targets: list[torch.Tensor], compute,
                outputs: Optional[list[torch.Tensor]] = None) -> float:
    """Mean squared difference between the block's outputs and `targets` over every window; the
    outputs are appended to `outputs` when given."""
    total, count = 0.0, 0
    for (hidden, kwargs), target in zip(batches, targets):
        with compute():
            out = call_block(layer, hidden, kwargs)
        total += float((out.float() - target.float()).pow(2).sum())
        count += target.numel()
        if outputs is not None:
            outputs.append(out)
    return total / max(count, 1)


@contextlib.contextmanager
def _learning(layer: torch.nn.Module, replaced: set[str]) -> Iterator[None]:
    """The block's parameters frozen, and in fp32 but for the `replaced` ones (the learned weights take
    their place), while it learns; exactly as they were afterwards."""
    saved = [(p, p.data, p.requires_grad) for p in layer.parameters()]
    for name, p in layer.named_parameters():
        p.requires_grad_(False)
        if name not in replaced:
            p.data = p.data.float()
    try:
        with torch.enable_grad():
            yield
    finally:
        for p, data, flag in saved:
            p.data = data
            p.requires_grad_(flag)


def _set_weights(layer: torch.nn.Module, qweights: dict[str, QuantizedWeight]) -> None:
    for name, qw in qweights.items():
        lin = layer.get_submodule(name)
        lin.weight.data = qw.dequantize().to(lin.weight.dtype)


def _autocast(device: torch.device, compute) -> Callable[[], Any]:
    """Learning's forwards: bf16 products on accelerators (fp32 range, so no gradient underflows as in
    fp16), and on the CPU whatever the pass's own forwards use."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return compute


def learn_progress(bar, every: int = 10) -> Callable[[int, float], None]:
    """A step callback showing the step and its minibatch loss on a tqdm bar, every `every` steps."""
    def show(step: int, loss: float) -> None:
        if step % every == 0:
            bar.set_postfix(learn=f"step {step} loss {loss:.3g}")
    return show


def learn_block(layer: torch.nn.Module, prefix: str, rounded: dict[str, torch.Tensor],
                start: dict[str, QuantizedWeight], batches: list[Batch], targets: list[torch.Tensor], cfg: LearnConfig,
                compute, seed: int = 0, on_step: Optional[Callable[[int, float], None]] = None,
                keep_outputs: bool = False,
                ) -> tuple[dict[str, QuantizedWeight], dict[str, Any], Optional[list[torch.Tensor]]]:
    """Learn the rounding of the block's linears from the `start` codes ({full module name: ...}).

    `rounded` ({name in the block: weight}) are the weights the start codes are the nearest codes of
    (finalize.py: W with AWQ's scales folded in, and GPTQ's errors fed back where its codes are kept),
    taken out of the dict as they are used;
    `batches` are the block's inputs as the pass holds them and `targets` the unquantized block's
    outputs on them. The layer holds the start codes' dequantized weights and is left holding the
    chosen codes' ones. `compute()` is the context of the pass's own forwards, by which both codes are
    judged. Returns the chosen codes (keyed as `start`), the report entry and, with `keep_outputs`
    when the learned codes are kept, the block's outputs on `batches` (computed to judge them: the
    next block's inputs, so the caller need not run the block again).
    """
    t0 = time.perf_counter()
    loss_start = block_error(layer, batches, targets, compute)
    start = {full[len(prefix) + 1 :]: qw for full, qw in start.items()}
    learned = {name: LearnedWeight(rounded.pop(name), qw) for name, qw in start.items()}  # anchors replace them
    autocast = _autocast(batches[0][0].device, compute)
    params = [p for lw in learned.values() for p in lw.parameters()]
    generator = torch.Generator().manual_seed(seed)
    step_losses = []
    with _learning(layer, {f"{name}.weight" for name in learned}):
        for step, (hidden, kwargs, target) in enumerate(_minibatches(batches, targets, cfg.batch, cfg.steps, generator)):
            with autocast():
                weights = {f"{name}.weight": lw.dequantized() for name, lw in learned.items()}
                out = call_block(layer, hidden, kwargs, weights)
            loss = (out.float() - target.float()).pow(2).mean()
            loss.backward()
            lr = cfg.lr * (1 - step / cfg.steps)
            with torch.no_grad():
                for p in params:
                    p.sub_(lr * torch.sign(p.grad))
                    p.grad = None
            for lw in learned.values():
                lw.project()
            step_losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, step_losses[-1])
    candidate = {name: lw.export() for name, lw in learned.items()}
    _set_weights(layer, candidate)
    outputs: Optional[list[torch.Tensor]] = [] if keep_outputs else None
    loss_learned = block_error(layer, batches, targets, compute, outputs)
    keep = math.isfinite(loss_learned) and loss_learned < loss_start
    if not keep:
        _set_weights(layer, start)
        outputs = None
    changed = sum(int((candidate[n].q != start[n].q).sum()) for n in start)
    tail = max(1, len(step_losses) // 10)
    entry = {
        "steps": cfg.steps, "lr": cfg.lr, "batch": cfg.batch, "loss_start": loss_start, "loss_learned": loss_learned,
        "kept": "learned" if keep else "start", "codes_changed": changed / sum(qw.q.numel() for qw in start.values()),
        "clip_mean": float(torch.cat([lw.clip.detach().flatten() for lw in learned.values()]).mean()),
        "step_loss_first": sum(step_losses[:tail]) / tail, "step_loss_last": sum(step_losses[-tail:]) / tail,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    chosen = candidate if keep else start
    return {f"{prefix}.{name}": qw for name, qw in chosen.items()}, entry, outputs
