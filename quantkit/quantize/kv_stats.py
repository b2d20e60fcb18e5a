"""KV-cache statistics: ranges of K (after rotary and any key norm) and V per layer, head and channel.

The model is run over calibration windows with an observing cache: a transformers `Cache` whose
layers see every layer's K and V exactly as attention would store them, record their ranges and
hand them back untouched. That works for every architecture the cache API serves, with no per-model
code for where rotary embeddings are applied.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, CacheLayerMixin

from quantkit.config import UserError
from quantkit.data import load_calibration
from quantkit.formats.checkpoint import INDEX_NAME
from quantkit.formats.compressed_tensors import KV_SCALE_NAMES, kv_cache_scales
from quantkit.formats.kv_stats import FILE_NAME, RANGE_NAMES, KVStats, write_kv_stats

log = logging.getLogger(__name__)


class _RangeObserver:
    """Running per-layer reductions of K and V over batch and tokens, each [heads, head_dim]: ranges, and
    the sum and count of K for its mean."""

    def __init__(self) -> None:
        self.ranges: dict[int, dict[str, torch.Tensor]] = {}
        self.k_sums: dict[int, tuple[torch.Tensor, int]] = {}
        self.tokens = 0

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        total, count = self.k_sums.get(layer, (0.0, 0))
        self.k_sums[layer] = (total + k.double().sum(dim=(0, 2)), count + k.shape[0] * k.shape[2])
        new = {}
        for prefix, x in (("k", k.float()), ("v", v.float())):
            new[f"{prefix}_min"] = x.amin(dim=(0, 2))
            new[f"{prefix}_max"] = x.amax(dim=(0, 2))
            new[f"{prefix}_absmax"] = x.abs().amax(dim=(0, 2))
        old = self.ranges.get(layer)
        if old is not None:
            for name, t in new.items():
                new[name] = torch.minimum(old[name], t) if name.endswith("_min") else torch.maximum(old[name], t)
        self.ranges[layer] = new  # on the states' device: no copy per call; `result` brings them to the host

    def result(self, windows: int) -> KVStats:
        if not self.ranges:
            raise RuntimeError("no attention layer reported K/V states: the model does not use a transformers Cache")
        layers = [self.ranges[i] for i in sorted(self.ranges)]
        sums = [self.k_sums[i] for i in sorted(self.ranges)]
        mean = torch.stack([(total / count).float().cpu() for total, count in sums])
        return KVStats(*(torch.stack([r[n].cpu() for r in layers]) for n in RANGE_NAMES), self.tokens, windows, mean)


class _ObservingLayer(CacheLayerMixin):
    """Records the states and returns them; stores nothing (one forward per fresh cache)."""

    is_sliding = False

    def __init__(self, observer: _RangeObserver, index: int) -> None:
        super().__init__()
        self.observer, self.index = observer, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.observer.observe(self.index, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _ObservingCache(Cache):
    def __init__(self, observer: _RangeObserver, num_layers: int) -> None:
        super().__init__(layers=[_ObservingLayer(observer, i) for i in range(num_layers)])


@torch.inference_mode()
def collect_kv_stats(model: torch.nn.Module, windows: torch.Tensor, progress: bool = True) -> KVStats:
    """Ranges of K and V over every token of `windows` [n, seqlen], on the model's own device and dtype."""
    observer = _RangeObserver()
    text = model.config.get_text_config(decoder=True)
    params = inspect.signature(type(model).forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    device = next(model.parameters()).device
    for w in tqdm(windows, desc="KV stats", disable=not progress, unit="window"):
        cache = _ObservingCache(observer, text.num_hidden_layers)
        model(w.unsqueeze(0).to(device), use_cache=True, **{cache_arg: cache})
        observer.tokens += w.numel()
    return observer.result(windows.shape[0])


def _with_cache(kwargs: dict[str, Any], cache: Cache) -> dict[str, Any]:
    """A decoder layer's recorded kwargs with `cache` where the layer takes its cache."""
    kw = dict(kwargs)
    key = next((k for k in ("past_key_values", "past_key_value", "cache") if k in kw), "past_key_values")
    kw[key] = cache
    return kw


class BlockKVStats:
    """KV statistics gathered during a block-by-block pass, with no second pass over the model.

    The hidden states of a few calibration windows follow the quantized blocks (the model as the
    checkpoint computes it): after each block is quantized, `advance` runs that block on them with
    an observing cache, which records K (after rotary and any key norm) and V as attention hands
    them to the cache: what `collect_kv_stats` records over the whole quantized model. On the
    pass's device, in its activation dtype."""

    def __init__(self, model: torch.nn.Module, spec, windows: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, batch_size: int) -> None:
        from quantkit.quantize.calibration import capture_inputs

        self.inputs = capture_inputs(model, spec, windows, batch_size, device, dtype)
        self.observer = _RangeObserver()
        self.observer.tokens = int(windows.numel())
        self.windows = windows.shape[0]
        self.num_layers = len(self.inputs.layer_kwargs)

    @torch.no_grad()
    def advance(self, index: int, layer: torch.nn.Module) -> None:
        """Run block `index` (quantized) on the windows' hidden states, observing its K and V."""
        from quantkit.quantize.calibration import call_layer

        for j, (hidden, kwargs) in enumerate(self.inputs.batches(index)):
            cache = _ObservingCache(self.observer, self.num_layers)
            self.inputs.hidden[j] = call_layer(layer, hidden, _with_cache(kwargs, cache))

    def result(self) -> KVStats:
        return self.observer.result(self.windows)


def _is_checkpoint(path: Path) -> bool:
    from quantkit.runtime.loader import read_quant_config

    try:
        read_quant_config(path)
        return True
    except UserError:
        return False


def _layer_order(module: str) -> tuple:
    """Sort key putting `model.layers.2.self_attn` before `model.layers.10.self_attn`."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", module))


def _kv_scale_files(checkpoint: Path) -> dict[str, list[str]]:
    """{weight file name: its `*.k_scale` / `*.v_scale` tensor names}, read from the index or the headers."""
    from safetensors import safe_open

    index = checkpoint / INDEX_NAME
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"].items()
    else:
        names = []
        for f in sorted(checkpoint.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as reader:
                names += [(key, f.name) for key in reader.keys()]
    files: dict[str, list[str]] = {}
    for key, fname in names:
        if key.rpartition(".")[2] in KV_SCALE_NAMES:
            files.setdefault(fname, []).append(key)
    return files


def _rewrite_tensors(file: Path, new: dict[str, torch.Tensor]) -> None:
    """Replace tensors of a safetensors file, keeping the others and its metadata; the new file is
    written beside the old one and moved over it, so a crash never leaves a half-written weight file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as reader:
        metadata = reader.metadata()
        tensors = {key: reader.get_tensor(key) for key in reader.keys()}
    for key, t in new.items():
        old = tensors[key]
        tensors[key] = t.to(old.dtype).reshape(old.shape)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _vllm_kv_scale_plan(checkpoint: Path, stats: KVStats) -> dict[str, dict[str, torch.Tensor]]:
    """{weight file: new tensors} for the checkpoint's vLLM fp8 KV scales (compressed-tensors
    `kv_cache_scheme`) from `stats`, computed as the export computes them; {} when it has none."""
    files = _kv_scale_files(checkpoint)
    if not files:
        qc = json.loads((checkpoint / "config.json").read_text()).get("quantization_config") or {}
        if qc.get("kv_cache_scheme"):
            log.warning("%s declares a kv_cache_scheme but no weight file holds k_scale/v_scale tensors: "
                        "no fp8 KV scales refreshed", checkpoint)
        return {}
    where = {key: fname for fname, keys in files.items() for key in keys}
    modules = sorted({key.rpartition(".")[0] for key in where}, key=_layer_order)
    if len(modules) != stats.num_layers or len(where) != 2 * len(modules):
        raise UserError(f"{checkpoint} holds k_scale/v_scale for {len(modules)} attention modules but the model has "
                        f"{stats.num_layers} layers: re-export it with `quantkit` to get matching fp8 KV scales")
    plan: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in kv_cache_scales(modules, stats.k_absmax, stats.v_absmax).items():
        plan.setdefault(where[key], {})[key] = t
    return plan


def kv_calibrate(model_path: str | Path, output: Optional[str | Path] = None, dataset: str = "ptb",
                 samples: int = 32, seqlen: int = 512, seed: int = 0, data_dir: Optional[str] = None,
                 device: Optional[str] = None, progress: bool = True) -> tuple[KVStats, Path]:
    """Collect KV statistics for a quantkit checkpoint (written into it, its report and any vLLM fp8 KV
    scales in its weights updated) or for an fp model (HF directory or .gguf; then `output`, a file or
    directory, is required)."""
    path = Path(model_path)
    checkpoint = path.is_dir() and _is_checkpoint(path)
    if output is None and not checkpoint:
        raise UserError(f"{path} is not a quantkit checkpoint: pass --output FILE for its {FILE_NAME}")
    into_checkpoint = checkpoint and (output is None or Path(output).resolve() == path.resolve())
    if checkpoint:
        # A checkpoint is measured as it runs: quantized weights change the K/V it produces.
        from quantkit.runtime.loader import load

        model, tokenizer = load(path, device=device)
    else:
        from quantkit.models.loading import load_fp_model

        loaded = load_fp_model(path, dtype=torch.float32)
        model, tokenizer = loaded.model, loaded.tokenizer
        if device:
            model.to(device)
    windows, source = load_calibration(tokenizer, dataset, samples, seqlen, seed, data_dir)
    stats = collect_kv_stats(model, windows, progress=progress)
    scale_plan = _vllm_kv_scale_plan(path, stats) if into_checkpoint else {}
    out = write_kv_stats(stats, output if output is not None else path)
    report_file = path / "quant_report.json"
    if into_checkpoint and report_file.is_file():
        report = json.loads(report_file.read_text())
        report["kv_stats"] = {**stats.summary(), "calibration": {"dataset": source.name, "split": source.split,
                                                                  "samples": samples, "seqlen": seqlen, "seed": seed}}
        report_file.write_text(json.dumps(report, indent=2))
    log.info("wrote %s (%d tokens)", out, stats.tokens)
    # vLLM reads these instead of the statistics: left as they were, the two would disagree.
    for fname, tensors in scale_plan.items():
        _rewrite_tensors(path / fname, tensors)
    if scale_plan:
        log.info("refreshed the fp8 KV scales in %s (%d k_scale/v_scale tensors)", ", ".join(sorted(scale_plan)),
                 sum(len(t) for t in scale_plan.values()))
    return stats, out
