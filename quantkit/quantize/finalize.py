"""The last step of a block: per linear, search its clip range, choose its integers, keep the result.

The layer keeps the dequantized weight afterwards, so the next forward (and the in-memory model)
computes what the checkpoint holds; the integer codes go back to the host as uint8.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantkit.config import QuantizeConfig
from quantkit.quantize.calibration import InputStats
from quantkit.quantize.primitives import QuantizedWeight, quantize_weight
from quantkit.quantize.rounding import gptq_codes, output_error
from quantkit.quantize.search import search_clip


def _codes_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits <= 8 else torch.int16


@torch.no_grad()
def quantize_linear(w: torch.Tensor, stats: InputStats, cfg: QuantizeConfig, clip: bool) -> tuple[QuantizedWeight, dict[str, Any]]:
    """Quantize W [out, in] (float32, scales already folded) with `stats` of its input; returns its report."""
    entry: dict[str, Any] = {}
    usable = not stats.nonfinite and stats.gram is not None
    max_val = min_val = None
    if clip and usable:
        res = search_clip(w, stats.group_gram(), cfg.weight, cfg.awq.n_grid, cfg.awq.max_shrink, cfg.awq.asym_clip)
        if math.isfinite(res.loss) and res.loss <= res.loss_noclip:
            max_val, min_val = res.max_val, res.min_val
        entry.update(loss_noclip=res.loss_noclip, loss=res.loss)
    qw = quantize_weight(w, cfg.weight, max_val, min_val)
    if cfg.awq.rounding == "gptq" and usable and stats.full:
        codes = gptq_codes(w, stats.gram, qw.scales, qw.zeros, qw.bits, qw.group_size)
        candidate = QuantizedWeight(codes, qw.zeros, qw.scales, qw.bits, qw.group_size)
        err_nearest = output_error(w, qw.dequantize(), stats.gram)
        err_gptq = output_error(w, candidate.dequantize(), stats.gram)
        entry.update(out_err_nearest=err_nearest, out_err_gptq=err_gptq)
        # The guard: error feedback keeps the codes only where it lowered the output error.
        if math.isfinite(err_gptq) and err_gptq < err_nearest:
            qw = candidate
    if not torch.isfinite(qw.dequantize()).all():  # never keep (or write) a non-finite weight
        qw = quantize_weight(torch.nan_to_num(w), cfg.weight)
        entry["fallback"] = "non-finite weight: plain RTN of nan_to_num"
    return qw, entry


@torch.no_grad()
def finalize_block(layer: torch.nn.Module, prefix: str, sets_stats: dict[tuple[str, ...], InputStats],
                   cfg: QuantizeConfig, clipped) -> tuple[dict[str, QuantizedWeight], dict[str, Any]]:
    """Quantize every linear of the block; `clipped(name)` says whether its clip range is searched."""
    out: dict[str, QuantizedWeight] = {}
    report: dict[str, Any] = {}
    for names, stats in sets_stats.items():
        for name in names:
            lin = layer.get_submodule(name)
            qw, entry = quantize_linear(lin.weight.data.float(), stats, cfg, cfg.awq.clip and clipped(name))
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            out[f"{prefix}.{name}"] = QuantizedWeight(qw.q.to(_codes_dtype(qw.bits)).cpu(), qw.zeros.cpu(),
                                                      qw.scales.cpu(), qw.bits, qw.group_size)
            if entry:
                report[name] = entry
    return out, report
