"""AWQ W4A16: the block-by-block calibration driver, generic over the registry's data.

Per decoder block: move it to the device; one fp forward over every calibration window gathers the
statistics (mean |x| and Gram matrices for each set of linears sharing an input) and the loss
modules' inputs on the search windows; then per registry group: search scales, fold them; then per
linear (finalize.py): search the clip range, choose the integers (nearest, or error feedback through
the Gram matrix: `rounding="gptq"`, the default), and put the dequantized weight back, so the
in-memory model computes what the checkpoint holds; with `rounding="learned"` the block's rounding
and clip ranges are then learned against the fp block's outputs (learned.py). `awq_blocks` then hands the block to its caller
(stream.py packs it there, on the device) and, once asked for the next one, propagates and releases
it (`BlockWeights`: back to the host, or dropped when it was read from the checkpoint's files for
this pass). The block's outputs become the next block's inputs.

Which outputs: with `propagate="quantized"` (default) the next block sees what the already
quantized blocks produce, so its statistics, searches and error feedback account for the error the
earlier blocks left, as GPTQ does; it costs a second forward of the block. `propagate="fp"`
reproduces the reference tools, which feed every block the fp model's activations.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import QuantizeConfig
from quantkit.models.lazy import BlockWeights
from quantkit.models.registry import ArchSpec, ScaleGroup
from quantkit.quantize.calibration import InputStats, call_layer, call_module, capture_inputs, gather_block
from quantkit.quantize.finalize import finalize_block
from quantkit.quantize.folding import fold_scales, head_tying, identity, output_channels
from quantkit.quantize.learned import learn_block, learn_progress, start_config
from quantkit.quantize.rtn import QuantizedBlock, decoder_layers
from quantkit.quantize.search import candidate_scales, search_scales, weight_magnitude

log = logging.getLogger(__name__)


def resolve_device(name: Optional[str]) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def input_sets(spec: ArchSpec) -> list[tuple[str, ...]]:
    """Linears that share one input: each registry group's linears, and every other linear alone."""
    sets = [tuple(g.linears) for g in spec.groups]
    covered = {name for s in sets for name in s}
    return sets + [(name,) for name in spec.linears if name not in covered]


def _clipped(spec: ArchSpec, name: str) -> bool:
    return name.rsplit(".", 1)[-1] not in spec.no_clip


class _Phases:
    """Wall time per phase, synchronising the accelerator so that time lands where it is spent."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def activation_dtype(device: torch.device) -> torch.dtype:
    """fp16 on accelerators (what AWQ consumers run in); fp32 on the CPU, whose fp16 arithmetic is slow."""
    return torch.float32 if device.type == "cpu" else torch.float16


def _compute(device: torch.device, cpu_bf16: bool) -> Callable[[], Any]:
    """Context for forwards: on the CPU, bf16 matrix products (AMX) over an fp32 block; else nothing."""
    if device.type == "cpu" and cpu_bf16:
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _search_group(layer, group: ScaleGroup, stats: InputStats, calls: list, model_config, cfg: QuantizeConfig,
                  fwd, gqa: bool) -> dict[str, Any]:
    """Search and fold one group's scales; returns its report entry."""
    prev = layer.get_submodule(group.prev)
    linears = [layer.get_submodule(n) for n in group.linears]
    loss_module = layer.get_submodule(group.loss_module)
    entry: dict[str, Any] = {"prev": group.prev, "linears": list(group.linears), "fallback": None}
    n_out, n_in = output_channels(prev), linears[0].in_features
    rows = None
    if group.prev_part is not None:  # only a slice of prev's outputs feeds the linears
        index, count = group.prev_part
        n_out //= count
        rows = slice(index * n_out, (index + 1) * n_out)
    reduce, expand = identity, identity
    if n_out != n_in:
        tying = head_tying(model_config, n_out, n_in) if gqa else None
        if tying is None:
            entry["fallback"] = "shapes differ (grouped-query attention); group skipped"
            return entry
        reduce, expand = tying.reduce, tying.expand
        entry["tied_heads"] = tying.repeat
    if stats.nonfinite or not calls:
        entry["fallback"] = "NaN/Inf in activations: plain RTN" if stats.nonfinite else "no search batches"
        return entry

    def run() -> list[torch.Tensor]:
        with fwd():
            return [call_module(loss_module, a, k) for a, k in calls]

    reference = run()
    if not all(torch.isfinite(r).all() for r in reference):
        entry["fallback"] = "NaN/Inf in the loss module's output: plain RTN"
        return entry
    x_mean = reduce(stats.mean_abs)
    gs = cfg.weight.effective_group_size(n_in)
    candidates = []
    duo_modes = {"on": (True,), "off": (False,), "both": (False, True)}[_duo_mode(cfg)]
    for duo in duo_modes:
        w_mean = reduce(weight_magnitude([lin.weight for lin in linears], gs)) if duo else None
        candidates += [(a, duo, s) for a, s in candidate_scales(x_mean, w_mean, cfg.awq.n_grid)]
    result = search_scales(linears, run, reference, candidates, expand, cfg.weight)
    entry.update(loss_rtn=result.loss_rtn, loss=result.loss, ratio=result.ratio, duo=result.duo)
    if result.scales is None:
        entry["fallback"] = "no scaling beat plain RTN"
        return entry
    fold_scales(prev, linears, result.scales, expand(result.scales), rows)
    stats.rescale(expand(result.scales))
    return entry


def _duo_mode(cfg: QuantizeConfig) -> str:
    duo = cfg.awq.duo_scaling
    if isinstance(duo, str):
        return duo
    return "on" if duo else "off"


def _empty_stats(layer, spec: ArchSpec, config: QuantizeConfig, device: torch.device) -> dict[tuple[str, ...], InputStats]:
    """Statistics to gather per set of linears sharing an input: Gram matrices only where used."""
    awq = config.awq
    out = {}
    for names in input_sets(spec):
        lin = layer.get_submodule(names[0])
        gram = None
        if awq.rounding == "gptq":
            gram = "full"
        elif awq.clip and any(_clipped(spec, n) for n in names):
            gram = "groups"
        out[names] = InputStats.empty(lin.in_features, config.weight.effective_group_size(lin.in_features),
                                      device, gram)
    return out


@dataclass
class _Pass:
    """One AWQ (or learned-rounding) pass's settings, resolved once, and what it reports."""

    spec: ArchSpec
    config: QuantizeConfig
    start: QuantizeConfig       # the codes learning starts from (the config itself without learning)
    learn: bool
    search: bool                # scale search (AWQ); off for RTN's learned rounding
    device: torch.device
    fwd: Callable[[], Any]
    phases: _Phases
    n_search: int               # windows the searches replay
    info: dict[str, Any]        # report["awq"] (or report["rtn"])

    @classmethod
    def begin(cls, spec: ArchSpec, config: QuantizeConfig, windows: torch.Tensor, report: dict[str, Any]) -> "_Pass":
        awq = config.awq
        # `rounding="learned"` (learned.py) starts from the codes of `start`; RTN's learned rounding runs
        # this same pass with the scale and clip searches off.
        learn = awq.rounding == "learned"
        device = resolve_device(config.device)
        n_search = min(windows.shape[0], max(1, math.ceil(awq.search_tokens / windows.shape[1])))
        info: dict[str, Any] = {
            "device": str(device), "activations": str(activation_dtype(device)).replace("torch.", ""),
            "cpu_bf16_matmul": device.type == "cpu" and awq.cpu_bf16,
            "propagate": awq.propagate,
            "propagate_why": ("outputs of the quantized block: later blocks see, and correct for, the error of earlier ones"
                              if awq.propagate == "quantized" else "outputs of the fp block, as the reference tools"),
            "rounding": awq.rounding, "search_windows": n_search, "calibration_tokens": int(windows.numel()),
            "blocks": [], "fallbacks": [],
        }
        report[config.method] = info
        return cls(spec, config, start_config(config) if learn else config, learn, config.method == "awq", device,
                   _compute(device, awq.cpu_bf16), _Phases(device), n_search, info)

    def quantize_block(self, model_config, layer, index: int, inputs, bar) -> tuple[dict, dict, Any, Any]:
        """Statistics, scale searches, clip + codes and (when learning) learned rounding for one block on
        the device. Returns (codes, the block's report entry, the fp outputs if still needed, the
        quantized block's outputs if learning computed them)."""
        spec, awq, phases, prefix = self.spec, self.config.awq, self.phases, f"{self.spec.layers_path}.{index}"
        stats = _empty_stats(layer, spec, self.start, self.device)
        loss_modules = [g.loss_module for g in spec.groups] if self.search else []
        with phases("forward"):
            fp_out, captured = gather_block(layer, inputs, index, stats, loss_modules, self.n_search, self.fwd,
                                            keep_outputs=awq.propagate == "fp" or self.learn)
        block: dict[str, Any] = {"index": index, "groups": []}
        with phases("search"):
            for gi, group in enumerate(spec.groups if self.search else ()):
                entry = _search_group(layer, group, stats[tuple(group.linears)], captured[gi], model_config,
                                      self.config, self.fwd, awq.gqa_scaling)
                block["groups"].append(entry)
                if entry["fallback"]:
                    self.info["fallbacks"].append(f"{prefix}: {group.prev} → {','.join(group.linears)}: {entry['fallback']}")
        del captured
        rounded: Optional[dict[str, torch.Tensor]] = {} if self.learn else None  # what the start codes round
        with phases("clip+quantize"):
            q, block["linears"] = finalize_block(layer, prefix, stats, self.start, lambda name: _clipped(spec, name),
                                                 rounded)
        del stats
        outputs = None  # the block's outputs on its inputs, when learning computed them for the codes kept
        if self.learn:
            with phases("learn"):
                q, block["learned"], outputs = learn_block(
                    layer, prefix, rounded, q, list(inputs.batches(index)), fp_out, self.config.learn,
                    self.fwd, seed=self.config.learn.seed + index, on_step=learn_progress(bar),
                    keep_outputs=awq.propagate == "quantized")
            del rounded
            if awq.propagate != "fp":
                fp_out = None  # the targets; only the fp propagation needs them further
        return q, block, fp_out, outputs

    def propagate(self, layer, index: int, inputs, fp_out, outputs) -> None:
        """The next block's inputs: this block's outputs, quantized (computed now unless learning has them)
        or fp."""
        if outputs is not None:
            inputs.hidden = outputs
        elif self.config.awq.propagate == "quantized":
            with self.phases("forward"), torch.no_grad():
                # Each batch's input is replaced by its output as soon as it is computed: one copy lives.
                for j, (hidden, kwargs) in enumerate(inputs.batches(index)):
                    with self.fwd():
                        inputs.hidden[j] = call_layer(layer, hidden, kwargs)
        else:
            inputs.hidden = fp_out

    def record(self, block: dict[str, Any], bar) -> None:
        """The block's search losses into the report, the log and the progress bar."""
        index = block["index"]
        searched = [g for g in block["groups"] if "loss" in g]
        before = sum(g["loss_rtn"] for g in searched)
        after = sum(g["loss"] for g in searched)
        block["loss_rtn"], block["loss"] = before, after
        self.info["blocks"].append(block)
        log.info("block %d: search loss %.4g → %.4g (%s)", index, before, after,
                 ", ".join(f"{g['prev']}:{'RTN' if g['fallback'] else format(g['ratio'], '.2f')}" for g in block["groups"]))
        bar.set_postfix(loss=f"{before:.3g}→{after:.3g}")
        if self.learn:
            e = block["learned"]
            log.info("block %d: output error %.4g → %.4g learned (%s kept)", index, e["loss_start"], e["loss_learned"],
                     e["kept"])
        self.info["phases_s"] = {k: round(v, 3) for k, v in self.phases.seconds.items()}


def awq_blocks(
    model: torch.nn.Module, spec: ArchSpec, config: QuantizeConfig, windows: torch.Tensor, report: dict[str, Any],
    blocks: Optional[BlockWeights] = None, progress: bool = True,
) -> Iterator[QuantizedBlock]:
    """AWQ-quantize `model`'s blocks one at a time with calibration `windows` [n, seqlen], yielding each.

    `blocks` says where each block's weights come from and what happens to them once it is done
    (default: they are in the model and go back to the host, holding their dequantized weights, with
    the scales folded in). The caller uses a yielded block (packs it) before asking for the next:
    only then is it propagated and released. Settings, losses, ratios, fallbacks and per-phase
    times go into `report["awq"]`.
    """
    blocks = blocks or BlockWeights()
    run = _Pass.begin(spec, config, windows, report)
    device = run.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with run.phases("capture"):
        inputs = capture_inputs(model, spec, windows, config.calib.batch_size, device, activation_dtype(device))
    bar = tqdm(decoder_layers(model, spec), desc=f"{config.method.upper()} W{config.weight.bits}",
               disable=not progress, unit="block")
    for index, layer in enumerate(bar):
        with run.phases("load"):
            blocks.load(index, layer)
        store_dtype = next(layer.parameters()).dtype
        with run.phases("transfer"):
            layer.to(device=device, dtype=activation_dtype(device))
        q, block, fp_out, outputs = run.quantize_block(model.config, layer, index, inputs, bar)
        yield QuantizedBlock(index, f"{spec.layers_path}.{index}", layer, q)
        del q
        run.propagate(layer, index, inputs, fp_out, outputs)
        del fp_out, outputs
        with run.phases("transfer"):
            blocks.release(index, layer, store_dtype)
        run.record(block, bar)
    if device.type == "cuda":
        run.info["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1024**3
