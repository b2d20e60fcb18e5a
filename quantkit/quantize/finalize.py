"""The last step of a block: per linear, search its clip range, choose its integers, keep the result.

The layer keeps the dequantized weight afterwards, so the next forward (and the in-memory model)
computes what the checkpoint holds; the integer codes stay on the block's device as uint8, where
the export packs them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from quantkit.config import QuantizeConfig
from quantkit.quantize.calibration import InputStats
from quantkit.quantize.primitives import QuantizedWeight, quantize_weight
from quantkit.quantize.rounding import gptq_round, output_error
from quantkit.quantize.search import search_clip


def _codes_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits <= 8 else torch.int16


@torch.no_grad()
def nearest(w: torch.Tensor, stats: InputStats, cfg: QuantizeConfig, clip: bool) -> tuple[QuantizedWeight, dict[str, Any]]:
    """W [out, in] (float32, scales already folded) with its clip range searched, rounded to nearest."""
    entry: dict[str, Any] = {}
    max_val = min_val = None
    if clip and not stats.nonfinite and stats.gram is not None:
        res = search_clip(w, stats.group_gram(), cfg.weight, cfg.awq.n_grid, cfg.awq.max_shrink, cfg.awq.asym_clip)
        if math.isfinite(res.loss) and res.loss <= res.loss_noclip:
            max_val, min_val = res.max_val, res.min_val
        entry.update(loss_noclip=res.loss_noclip, loss=res.loss)
    return quantize_weight(w, cfg.weight, max_val, min_val), entry


@torch.no_grad()
def error_feedback(ws: list[torch.Tensor], qws: list[QuantizedWeight], stats: InputStats,
                   entries: list[dict[str, Any]], rounded: Optional[list[torch.Tensor]] = None) -> list[QuantizedWeight]:
    """GPTQ codes for linears sharing one input, in one pass over their stacked rows (rows are
    independent given H, so stacking q, k, v or gate, up is exact and saves a column loop each), on
    the grid of their nearest-rounded weights `qws` (integer groups, or e4m3 for `Fp8Weight`s).

    `rounded`, when given, receives per linear the weights its codes are the nearest codes of: W with
    the errors fed back where the GPTQ codes are kept, else W (learned rounding starts from them)."""
    grids = [q.grid() for q in qws]
    updated = None if rounded is None else torch.empty(sum(w.shape[0] for w in ws), ws[0].shape[1], device=ws[0].device)
    codes = gptq_round(torch.cat(ws), stats.gram, torch.cat([g[0] for g in grids]), torch.cat([g[1] for g in grids]),
                       grids[0][2], qws[0].group_size, updated=updated)
    if codes is None:
        for e in entries:
            e["fallback"] = "Gram matrix not positive definite: nearest rounding"
        if rounded is not None:
            rounded.extend(ws)
        return qws
    out, row = [], 0
    for w, qw, entry in zip(ws, qws, entries):
        rows = slice(row, row + w.shape[0])
        candidate = qw.with_codes(codes[rows])
        row += w.shape[0]
        err_nearest = output_error(w, qw.dequantize(), stats.gram)
        err_gptq = output_error(w, candidate.dequantize(), stats.gram)
        entry.update(out_err_nearest=err_nearest, out_err_gptq=err_gptq)
        # The guard: error feedback keeps the codes only where it lowered the output error.
        kept = math.isfinite(err_gptq) and err_gptq < err_nearest
        out.append(candidate if kept else qw)
        if rounded is not None:
            rounded.append(updated[rows] if kept else w)
    return out


@torch.no_grad()
def finalize_block(layer: torch.nn.Module, prefix: str, sets_stats: dict[tuple[str, ...], InputStats],
                   cfg: QuantizeConfig, clipped, rounded: Optional[dict[str, torch.Tensor]] = None,
                   ) -> tuple[dict[str, QuantizedWeight], dict[str, Any]]:
    """Quantize every linear of the block; `clipped(name)` says whether its clip range is searched.
    `rounded`, when given, receives per linear (name in the block) the float32 weights whose nearest
    codes the codes are: W, or W with GPTQ's errors fed back."""
    out: dict[str, QuantizedWeight] = {}
    report: dict[str, Any] = {}
    for names, stats in sets_stats.items():
        ws = [layer.get_submodule(n).weight.data.float() for n in names]
        results = [nearest(w, stats, cfg, cfg.awq.clip and clipped(n)) for w, n in zip(ws, names)]
        qws, entries = [r[0] for r in results], [r[1] for r in results]
        anchors = None  # with `rounded`: the weights rounded, when error feedback changed them
        if cfg.awq.rounding == "gptq" and stats.full and not stats.nonfinite:
            anchors = [] if rounded is not None else None
            qws = error_feedback(ws, qws, stats, entries, anchors)
        for name, w, qw, entry, anchor in zip(names, ws, qws, entries, anchors or ws):
            if not torch.isfinite(qw.dequantize()).all():  # never keep (or write) a non-finite weight
                anchor = torch.nan_to_num(w)
                qw = quantize_weight(anchor, cfg.weight)
                entry["fallback"] = "non-finite weight: plain RTN of nan_to_num"
            if rounded is not None:
                rounded[name] = anchor.float()
            lin = layer.get_submodule(name)
            lin.weight.data = qw.dequantize().to(lin.weight.dtype)
            out[f"{prefix}.{name}"] = QuantizedWeight(qw.q.to(_codes_dtype(qw.bits)), qw.zeros, qw.scales,
                                                      qw.bits, qw.group_size)
            if entry:
                report[name] = entry
    return out, report
