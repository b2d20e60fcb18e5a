"""`quantize()`: the one library call behind `quantkit rtn`, `quantkit int8`, `quantkit awq` and `quantkit fp8`."""

from __future__ import annotations

import logging
import platform
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from quantkit.config import QuantizeConfig
from quantkit.data import (
    calibration_windows,
    check_calibration,
    load_calibration,
    tokenize_text,
    window_sampling,
)
from quantkit.formats.checkpoint import check_work_dir
from quantkit.models.loading import LoadedModel, load_fp_model
from quantkit.models.registry import spec_for_config
from quantkit.quantize.export import write_export
from quantkit.quantize.rtn import check_group_size
from quantkit.quantize.stream import BlockPass

log = logging.getLogger(__name__)

Calib = Union[None, str, Sequence[str], torch.Tensor]
# KV statistics come from the first windows: ranges settle quickly.
KV_WINDOWS = 16


@dataclass
class QuantizeResult:
    """What a run produced: the checkpoint path (if written) and the report; without a work dir, the
    checkpoint's tensors (packed linears, fp16 rest) in `tensors` instead."""

    work_dir: Optional[Path]
    report: dict[str, Any]
    tensors: dict = field(repr=False, default_factory=dict)


def _peak_rss_gb() -> float:
    """This process's peak resident memory: VmHWM where Linux gives it (ru_maxrss also counts, after
    a fork and exec, the peak of the parent before the exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _versions() -> dict[str, str]:
    import transformers

    from quantkit.version import __version__

    return {"quantkit": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def resolve_calibration(loaded: LoadedModel, config: QuantizeConfig, calib: Calib) -> tuple[torch.Tensor, dict]:
    """Token windows [n, seqlen] from a dataset name/path, a list of texts or ready token windows."""
    c = config.calib
    if isinstance(calib, torch.Tensor):
        windows = calib.long()
        return windows, {"kind": "token windows", "shape": list(windows.shape)}
    if calib is not None and not isinstance(calib, str):
        tokens = tokenize_text(loaded.tokenizer, "\n\n".join(calib))
        windows = calibration_windows(tokens, c.samples, min(c.seqlen, tokens.numel() - 1), c.seed)
        return windows, {"kind": "texts", "texts": len(calib), "samples": c.samples, "seqlen": windows.shape[1], "seed": c.seed,
                         "sampling": window_sampling(tokens.numel(), c.samples, windows.shape[1])}
    dataset = calib if isinstance(calib, str) else c.dataset
    windows, source = load_calibration(loaded.tokenizer, dataset, c.samples, c.seqlen, c.seed, c.data_dir)
    return windows, {"kind": "dataset", "dataset": source.name, "split": source.split, "origin": source.origin,
                     "samples": c.samples, "seqlen": c.seqlen, "seed": c.seed, "sampling": source.sampling}


def _load(model_or_path: Any, tokenizer: Any = None) -> LoadedModel:
    if isinstance(model_or_path, LoadedModel):
        return model_or_path
    if isinstance(model_or_path, (str, Path)):
        return load_fp_model(model_or_path, lazy_blocks=True)  # each block read when its turn comes
    if tokenizer is None:
        raise ValueError("quantize(model, …) with an in-memory model needs tokenizer=… as well")
    return LoadedModel(model_or_path, tokenizer, spec_for_config(model_or_path.config), "in-memory model")


def quantize(
    model_or_path: Any,
    config: QuantizeConfig,
    calib: Calib = None,
    work_dir: Optional[Union[str, Path]] = None,
    overwrite: bool = False,
    tokenizer: Any = None,
    progress: bool = True,
    kv_calib: Calib = None,
) -> QuantizeResult:
    """Quantize a model (path, `LoadedModel` or transformers model + `tokenizer`) under `config`.

    `calib` is a dataset name or path, a list of texts, or token windows [n, seqlen]; RTN, int8 and
    dynamic FP8 need none (RTN with `awq.rounding="learned"`, static FP8 and FP8 with `fp8.rounding="gptq"` do).
    With `work_dir` the packed checkpoint is
    written there (atomically). KV-cache statistics (quantkit/kv_stats.safetensors) are written from
    the calibration windows, or from `kv_calib` (same forms as `calib`) for any method, measured on
    the quantized blocks.

    One pass, block by block (stream.py): a model given as a path has each decoder block read from
    its files when its turn comes and released once packed, so the host holds the embeddings, one
    block and the shard being written. An in-memory model keeps its weights: afterwards each
    quantized linear holds its dequantized weight (AWQ's scales folded in), so it computes what the
    checkpoint holds.
    """
    if work_dir is not None:
        check_work_dir(Path(work_dir), overwrite)
    if config.calibrated:  # missing, empty or too short text: refused before the model loads
        check_calibration(calib, config.calib)
    t0 = time.perf_counter()
    loaded = _load(model_or_path, tokenizer)
    timings: dict[str, float] = {"load": time.perf_counter() - t0}
    check_group_size(loaded.model, loaded.spec, config.weight)
    report: dict[str, Any] = {"method": config.method, "config": config.to_dict(), "format": config.resolved_format,
                              "source": loaded.source, "architecture": loaded.spec.name}
    t1 = time.perf_counter()
    windows = kv_windows = None
    report["calibration"] = None
    if config.calibrated:
        windows, report["calibration"] = resolve_calibration(loaded, config, calib)
    if work_dir is not None:
        if kv_calib is not None:
            kv_windows = resolve_calibration(loaded, config, kv_calib)[0][:KV_WINDOWS]
        elif windows is not None:
            kv_windows = windows[:KV_WINDOWS]
    block_pass = BlockPass(loaded, config, windows, kv_windows, report, progress=progress)

    def finish() -> dict:
        """Called once every tensor is produced, before the report is written."""
        timings["quantize"] = time.perf_counter() - t1
        timings.update({k: round(v, 3) for k, v in block_pass.seconds.items()})
        report["timings_s"] = timings
        report["versions"] = _versions()
        report["peak_host_memory_gb"] = _peak_rss_gb()
        if torch.cuda.is_available():
            report["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1024**3
        report["wall_time_s"] = time.perf_counter() - t0
        return block_pass.extra_files()

    out, tensors = None, {}
    if work_dir is not None:
        out = write_export(loaded, block_pass.tensors(), config, Path(work_dir), report, overwrite=overwrite,
                           extra_tensor_files=finish)
        timings["write"] = time.perf_counter() - t1 - timings["quantize"]
        log.info("wrote %s in %.1fs", out, time.perf_counter() - t0)
    else:
        tensors = dict(block_pass.tensors())
        finish()
    report["wall_time_s"] = time.perf_counter() - t0
    return QuantizeResult(out, report, tensors)
