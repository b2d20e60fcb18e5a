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
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, CacheLayerMixin

from quantkit.config import UserError
from quantkit.data import load_calibration
from quantkit.formats.kv_stats import FILE_NAME, RANGE_NAMES, KVStats, write_kv_stats

log = logging.getLogger(__name__)


class _RangeObserver:
    """Running per-layer reductions of K and V over batch and tokens, each [heads, head_dim]."""

    def __init__(self) -> None:
        self.ranges: dict[int, dict[str, torch.Tensor]] = {}
        self.tokens = 0

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
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
        return KVStats(*(torch.stack([r[n].cpu() for r in layers]) for n in RANGE_NAMES), self.tokens, windows)


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


def kv_calibrate(model_path: str | Path, output: Optional[str | Path] = None, dataset: str = "ptb",
                 samples: int = 32, seqlen: int = 512, seed: int = 0, data_dir: Optional[str] = None,
                 device: Optional[str] = None, progress: bool = True) -> tuple[KVStats, Path]:
    """Collect KV statistics for a quantkit checkpoint (written into it, its report updated) or for an
    fp model (HF directory or .gguf; then `output`, a file or directory, is required)."""
    path = Path(model_path)
    checkpoint = path.is_dir() and _is_checkpoint(path)
    if output is None and not checkpoint:
        raise UserError(f"{path} is not a quantkit checkpoint: pass --output FILE for its {FILE_NAME}")
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
    out = write_kv_stats(stats, output if output is not None else path)
    report_file = path / "quant_report.json"
    if checkpoint and report_file.is_file() and output is None:
        report = json.loads(report_file.read_text())
        report["kv_stats"] = {**stats.summary(), "calibration": {"dataset": source.name, "split": source.split,
                                                                  "samples": samples, "seqlen": seqlen, "seed": seed}}
        report_file.write_text(json.dumps(report, indent=2))
    log.info("wrote %s (%d tokens)", out, stats.tokens)
    return stats, out
