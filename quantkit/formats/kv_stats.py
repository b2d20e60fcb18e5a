"""`quantkit/kv_stats.safetensors`: per layer, per KV head, per channel ranges of K (after rotary) and V.

The file holds six float32 tensors of shape [layers, kv_heads, head_dim] — `k_min`, `k_max`,
`k_absmax`, `v_min`, `v_max`, `v_absmax` — reduced over every calibration token, and two int64
scalars, `tokens` and `windows`; and `k_mean`, the mean of each key channel (same shape), which KV4 pools
subtract from keys before rotating them (kernels/kv_rotation.py; older files lack it: recalibrate).
Per-head figures are reductions over the last axis; keeping the channels keeps the outlier channels
keys carry visible.

It lives in a `quantkit/` subfolder of the checkpoint, not at its root: transformers, vLLM and
lmdeploy read every `*.safetensors` at the root as weights when there is no index (vLLM then
fails with "no module or parameter named 'k_absmax'"), and none of them looks into subfolders.
Checkpoints written before keep the file at the root (`LEGACY_FILE_NAME`); it is still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from quantkit.config import UserError

FILE_NAME = "quantkit/kv_stats.safetensors"  # relative to the checkpoint directory
LEGACY_FILE_NAME = "kv_stats.safetensors"  # at the root, where weight loaders take it for weights
RANGE_NAMES = ("k_min", "k_max", "k_absmax", "v_min", "v_max", "v_absmax")


class KVStatsError(UserError):
    """KV statistics are missing or malformed; the message says how to produce them."""


@dataclass
class KVStats:
    """Observed ranges of the KV cache; every range tensor is float32 [layers, kv_heads, head_dim]."""

    k_min: torch.Tensor
    k_max: torch.Tensor
    k_absmax: torch.Tensor
    v_min: torch.Tensor
    v_max: torch.Tensor
    v_absmax: torch.Tensor
    tokens: int
    windows: int
    k_mean: Optional[torch.Tensor] = None  # None in files written before it was recorded

    @property
    def num_layers(self) -> int:
        return self.k_min.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_min.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_min.shape[2]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as written to the file."""
        out = {name: getattr(self, name).to(torch.float32, copy=True).contiguous() for name in RANGE_NAMES}
        if self.k_mean is not None:
            out["k_mean"] = self.k_mean.to(torch.float32, copy=True).contiguous()
        out["tokens"] = torch.tensor(self.tokens, dtype=torch.int64)
        out["windows"] = torch.tensor(self.windows, dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], origin: str = "kv stats") -> "KVStats":
        missing = [n for n in (*RANGE_NAMES, "tokens", "windows") if n not in tensors]
        if missing:
            raise KVStatsError(f"{origin} lacks {missing}: recreate it with `quantkit kv-calibrate`")
        shapes = {tuple(tensors[n].shape) for n in RANGE_NAMES}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3:
            raise KVStatsError(f"{origin} has range tensors of shapes {sorted(shapes)}, not one [layers, heads, dim]")
        mean = tensors.get("k_mean")
        if mean is not None and tuple(mean.shape) != next(iter(shapes)):
            raise KVStatsError(f"{origin} has k_mean of shape {tuple(mean.shape)}, not {next(iter(shapes))}")
        return cls(*(tensors[n].float() for n in RANGE_NAMES), int(tensors["tokens"]), int(tensors["windows"]),
                   None if mean is None else mean.float())

    def summary(self) -> dict[str, Any]:
        """A compact description for quant_report.json: sizes and per-layer maxima of |K| and |V|."""
        k_layer = self.k_absmax.amax(dim=(1, 2))
        v_layer = self.v_absmax.amax(dim=(1, 2))
        # How much the largest key channel stands out from the typical one, per head: KIVI's outliers.
        k_outlier = (self.k_absmax.amax(-1) / self.k_absmax.median(-1).values.clamp_min(1e-6)).amax().item()
        return {
            "file": FILE_NAME, "layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "tokens": self.tokens, "windows": self.windows,
            "k_absmax_per_layer": [round(x, 4) for x in k_layer.tolist()],
            "v_absmax_per_layer": [round(x, 4) for x in v_layer.tolist()],
            "k_channel_outlier_ratio": round(k_outlier, 2),
        }


def kv_stats_file(directory: str | Path) -> Path | None:
    """The statistics file of a checkpoint directory: its own place, else the old root one, else None."""
    directory = Path(directory)
    return next((f for f in (directory / FILE_NAME, directory / LEGACY_FILE_NAME) if f.is_file()), None)


def write_kv_stats(stats: KVStats, path: str | Path) -> Path:
    """Write `stats` to `path`: a file, or a directory that receives quantkit/kv_stats.safetensors
    (and loses a root kv_stats.safetensors of an older layout, which weight loaders would misread)."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_dir():
        (path / LEGACY_FILE_NAME).unlink(missing_ok=True)
        path = path / FILE_NAME
        path.parent.mkdir(exist_ok=True)
    save_file(stats.to_tensors(), str(path))
    return path


def read_kv_stats(path: str | Path) -> KVStats:
    """Read statistics from a .safetensors file or from a checkpoint directory holding one."""
    from safetensors.torch import load_file

    path = Path(path)
    file = (kv_stats_file(path) or path / FILE_NAME) if path.is_dir() else path
    if not file.is_file():
        raise KVStatsError(
            f"{file} does not exist: static KV scales need calibration statistics; "
            f"run `quantkit kv-calibrate {path} --calib-dataset ptb` or use --kv-scales online"
        )
    return KVStats.from_tensors(load_file(str(file)), str(file))
