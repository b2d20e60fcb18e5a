"""Static KV scales for the paged pool: one scale and zero per layer and KV head, from the calibration
statistics of `quantkit/kv_stats.safetensors` (formats/kv_stats.py), instead of each token's own range.

The write stores them in the pool's per-token scale and zero slots, so attention reads the same layout
either way; values beyond the calibrated range are clipped. Per-head only (per-channel key scales would
need another read path); the scales are of unrotated K and V, so a static pool is never rotated.

The same statistics give the key centres that a rotated (KV4 online) pool subtracts from every key
(`key_centers`, loaded with the model by `set_key_centers`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from torch import Tensor

from quantkit.formats.kv_stats import FILE_NAME, KVStats, KVStatsError, kv_stats_file, read_kv_stats
from quantkit.kernels.paged_kv import static_scales

log = logging.getLogger(__name__)


def stats_file_for(model_path: str | Path, kv_stats: Optional[str | Path] = None) -> Path:
    """The statistics file static scales read: `kv_stats` (a file, or a directory holding one) when given,
    else the checkpoint's own; a one-line error saying how to make one when there is none."""
    where = Path(kv_stats) if kv_stats is not None else Path(model_path)
    if where.is_dir():
        found = kv_stats_file(where)
    else:  # a .gguf model is a file too, and holds no statistics
        found = where if where.is_file() and where.suffix == ".safetensors" else None
    if found is None:
        make = (f"`quantkit kv-calibrate {model_path} -o {model_path}` (`quantkit awq` writes them)"
                if Path(model_path).is_dir() else
                f"`quantkit kv-calibrate {model_path} -o STATS.safetensors` and pass --kv-stats STATS.safetensors")
        raise KVStatsError(f"--kv-scales static needs KV statistics, and {where} has no {FILE_NAME}: run {make}, "
                           "or use --kv-scales online")
    return found


def layer_scales(stats: KVStats, bits: int, num_layers: int, kv_heads: int,
                 head_dim: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per layer, (k_scale, k_zero, v_scale, v_zero) [kv_heads] for `PagedKV.allocate(static=...)`."""
    want, have = (num_layers, kv_heads, head_dim), (stats.num_layers, stats.num_kv_heads, stats.head_dim)
    if want != have:
        raise KVStatsError(f"the KV statistics are for {have[0]} layers × {have[1]} KV heads × {have[2]} channels, "
                           f"but the model has {want[0]} × {want[1]} × {want[2]}: recalibrate this model "
                           "with `quantkit kv-calibrate`")
    return [static_scales(stats.k_min[i], stats.k_max[i], stats.v_min[i], stats.v_max[i], bits)
            for i in range(num_layers)]


def pool_static_scales(config, num_layers: int, kv_heads: int, head_dim: int) -> Optional[list]:
    """What the model runner gives each layer's pool: None for online scales or an unquantized pool,
    else `layer_scales` of the statistics file `config.kv_stats`."""
    if not config.static_kv_scales:
        return None
    if config.kv_stats is None:
        raise KVStatsError("--kv-scales static needs KV statistics: pass EngineConfig(kv_stats=FILE) or "
                           "run `quantkit kv-calibrate MODEL`")
    return layer_scales(read_kv_stats(config.kv_stats), config.kv_bits, num_layers, kv_heads, head_dim)


def key_centers(stats: KVStats) -> list[Tensor]:
    """Per layer, each key channel's calibrated mean [kv_heads, head_dim] (statistics written before means
    were recorded: the midpoint of its range, which an extreme token pulls off centre): what a rotated
    pool subtracts from every key (kernels/kv_rotation.py). Any vector keeps attention exact; this one
    takes the channels' fixed offsets out of the per-token int4 codes."""
    if stats.k_mean is not None:
        return list(stats.k_mean)
    return [(stats.k_min[i] + stats.k_max[i]) / 2 for i in range(stats.num_layers)]


def set_key_centers(model, directory: Path) -> None:
    """Give each attention layer of a DecoderModel its key centres from the statistics a checkpoint holds
    (`quantkit awq` and `quantkit kv-calibrate` write them); without statistics, or with statistics of
    another shape (logged), keys are rotated uncentred."""
    found = kv_stats_file(directory)
    if found is None:
        return
    stats = read_kv_stats(found)
    layers = model.model.layers
    want = (len(layers), model.num_kv_heads, model.head_dim)
    if (stats.num_layers, stats.num_kv_heads, stats.head_dim) != want:
        log.warning("%s holds KV statistics of another shape than the model (%s): KV4 keys are not centred; "
                    "recalibrate with `quantkit kv-calibrate`", found, want)
        return
    if stats.k_mean is None:
        log.info("%s records no key means: KV4 keys are centred on their ranges' midpoints; `quantkit "
                 "kv-calibrate %s` records the means, which KV4 loses less with", found, directory)
    for layer, center in zip(layers, key_centers(stats)):
        layer.self_attn.attn.k_center = center.to(device=model.device, dtype=model.dtype)
