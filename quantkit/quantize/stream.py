"""The one pass behind `quantize()`: block by block, load → quantize → pack → release.

Per decoder block, on the accelerator when there is one: its weights are loaded (read from the
checkpoint's files for a model loaded with `lazy_blocks`), quantized (AWQ, RTN or FP8), its codes packed
into the export format there, and only the packed tensors go back to the host, where the checkpoint
writer takes them into the shard being filled; then the block's weights are released. When KV
statistics are wanted, a few windows' hidden states follow the quantized blocks and each block's
K and V are observed on them (`BlockKVStats`), so no second pass over the model is made.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from typing import Any, Iterator, Optional

import torch

from quantkit.config import QuantizeConfig
from quantkit.formats.kv_stats import FILE_NAME as KV_STATS_FILE
from quantkit.formats.kv_stats import KVStats
from quantkit.models.lazy import BlockWeights
from quantkit.models.loading import LoadedModel
from quantkit.quantize.awq import activation_dtype, awq_blocks, resolve_device
from quantkit.quantize.export import ExtraFiles, block_tensors, stem_tensors
from quantkit.quantize.fp8 import fp8_blocks
from quantkit.quantize.kv_stats import BlockKVStats
from quantkit.quantize.rtn import rtn_blocks

Named = tuple[str, torch.Tensor]


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _return_freed_host_memory() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise): packed tensors of
    a few MB each come and go every block, and a kept heap would grow the resident size block by block."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


class BlockPass:
    """The checkpoint's tensors of `loaded` under `config`, produced block by block by `tensors()`.

    `windows` are the calibration windows (None for RTN, unless it learns its rounding, int8 and dynamic FP8 rounded
    to nearest);
    `kv_windows`, when given, are the windows whose K/V ranges become `kv_stats`. Phase times go
    into `seconds`."""

    def __init__(self, loaded: LoadedModel, config: QuantizeConfig, windows: Optional[torch.Tensor],
                 kv_windows: Optional[torch.Tensor], report: dict[str, Any], progress: bool = True) -> None:
        self.loaded, self.config, self.windows, self.kv_windows = loaded, config, windows, kv_windows
        self.report, self.progress = report, progress
        self.kv_stats: Optional[KVStats] = None
        self.seconds: dict[str, float] = {"pack": 0.0, "kv_stats": 0.0, "write_shards": 0.0}

    def _blocks(self, device: torch.device, dtype: torch.dtype):
        model, spec, cfg = self.loaded.model, self.loaded.spec, self.config
        weights = self.loaded.blocks or BlockWeights()
        if cfg.method == "fp8":
            return fp8_blocks(model, spec, cfg, self.windows, self.report, weights, progress=self.progress)
        if cfg.calibrated:  # AWQ, or RTN with learned rounding: the calibrated pass
            return awq_blocks(model, spec, cfg, self.windows, self.report, weights, progress=self.progress)
        return rtn_blocks(model, spec, cfg.weight, device, dtype, weights, progress=self.progress)

    def _timed(self, phase: str, t0: float) -> None:
        self.seconds[phase] += time.perf_counter() - t0

    def tensors(self) -> Iterator[Named]:
        """(name, tensor) pairs: the non-block tensors first, then each block's as it is done."""
        model, spec = self.loaded.model, self.loaded.spec
        t0 = time.perf_counter()
        yield from stem_tensors(model, spec).items()
        self._timed("write_shards", t0)
        device = resolve_device(self.config.device)
        dtype = activation_dtype(device)
        kv = None
        if self.kv_windows is not None:
            t0 = time.perf_counter()
            kv = BlockKVStats(model, spec, self.kv_windows, device, dtype, self.config.calib.batch_size)
            self._timed("kv_stats", t0)
        for qb in self._blocks(device, dtype):
            t0 = time.perf_counter()
            packed = block_tensors(qb.layer, qb.prefix, qb.qweights, self.config)
            self._timed("pack", t0)
            if kv is not None:
                t0 = time.perf_counter()
                kv.advance(qb.index, qb.layer)
                self._timed("kv_stats", t0)
            t0 = time.perf_counter()
            yield from packed.items()  # the writer may write a full shard here
            del packed, qb
            _return_freed_host_memory()
            self._timed("write_shards", t0)
        if kv is not None:
            self.kv_stats = kv.result()
            self.report["kv_stats"] = self.kv_stats.summary()

    def extra_files(self) -> ExtraFiles:
        """The export's extra tensor files once `tensors()` is consumed: the KV statistics, if gathered."""
        return {KV_STATS_FILE: self.kv_stats.to_tensors()} if self.kv_stats is not None else {}
