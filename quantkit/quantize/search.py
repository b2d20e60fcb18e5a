"""AWQ's two searches: per-channel input scales for a group of linears, and per-group clip ranges.

Scale search (Lin et al. 2023): for a ratio α on a grid, s = mean|x|^α (duo scaling also divides by
the weights' own normalised magnitude^(1−α)), normalised to a geometric mean of about 1; the group's
linears become Q(W·s)/s and the candidate with the least output MSE of the group's loss module wins.
s = 1 (plain RTN) is always a candidate, so no search ends worse than RTN on its own loss.

Clip search: per (output row, quantization group) the range [min, max] shrinks towards zero. The
objective is the group's partial-output error over every calibration token, δᵀ C δ with δ the
row's quantization error in that group and C the group's input Gram matrix: the quantity AutoAWQ
estimates from 512 sampled tokens, here exact for all of them at less cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from quantkit.config import WeightQuantConfig

# Keeps a channel that never fires from getting a zero (or NaN) scale.
_EPS = 1e-4


def fake_quantize(w: torch.Tensor, cfg: WeightQuantConfig, max_val: Optional[torch.Tensor] = None,
                  min_val: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize then dequantize W [out, in] (float32), bit for bit as `quantize_weight` + `dequantize`.

    The searches call this thousands of times, so it works in place on one grouped copy instead of
    going through the integer tensors (3-4x faster on the CPU); a test checks the equality.
    """
    out_f, in_f = w.shape
    gs = cfg.effective_group_size(in_f)
    g = w.float().reshape(out_f, in_f // gs, gs)
    qmax = 2**cfg.bits - 1
    if cfg.symmetric:
        absmax = g.abs().amax(-1, keepdim=True) if max_val is None else max_val.float().abs().unsqueeze(-1)
        scales = (absmax / (2 ** (cfg.bits - 1) - 1)).clamp_(min=1e-8)
        zeros = torch.full_like(scales, 2 ** (cfg.bits - 1))
    else:
        mx = (g.amax(-1, keepdim=True) if max_val is None else max_val.float().unsqueeze(-1)).clamp(min=0)
        mn = (g.amin(-1, keepdim=True) if min_val is None else min_val.float().unsqueeze(-1)).clamp(max=0)
        scales = ((mx - mn) / qmax).clamp_(min=1e-8)
        zeros = torch.round(-mn / scales).clamp_(0, qmax)  # from the fp32 scale, as compute_qparams does
    scales = scales.half().float().clamp_(min=torch.finfo(torch.float16).tiny)  # what the checkpoint stores
    q = torch.div(g, scales).round_().add_(zeros).clamp_(0, qmax)
    return q.sub_(zeros).mul_(scales).reshape(out_f, in_f)


def weight_magnitude(weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel, the mean over output rows of |w| / max|w| of its quantization group."""
    w = torch.cat([x.float() for x in weights], dim=0)
    g = w.abs().reshape(w.shape[0], -1, group_size)
    g = g / (g.amax(dim=-1, keepdim=True) + 1e-6)
    return g.reshape(w.shape).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: Optional[torch.Tensor], n_grid: int) -> list[tuple[float, torch.Tensor]]:
    """(α, s) for α = 0, 1/n, …, (n−1)/n; `w_mean` given means duo scaling."""
    out = []
    x = x_mean.float().clamp(min=_EPS)
    for i in range(n_grid):
        alpha = i / n_grid
        s = x.pow(alpha)
        if w_mean is not None:
            s = s / (w_mean.float().pow(1 - alpha) + _EPS)
        s = s.clamp(min=_EPS)
        s = s / (s.max() * s.min()).sqrt()
        if torch.isfinite(s).all():
            out.append((alpha, s))
    return out


@dataclass
class ScaleResult:
    """The chosen scales (None: plain RTN won), the losses of RTN and of the winner, every candidate's loss."""

    scales: Optional[torch.Tensor]
    ratio: Optional[float]
    duo: Optional[bool]
    loss_rtn: float
    loss: float
    losses: list[float] = field(default_factory=list)


@torch.no_grad()
def search_scales(
    linears: Sequence[torch.nn.Linear],
    run_loss_module: Callable[[], list[torch.Tensor]],
    reference: list[torch.Tensor],
    candidates: list[tuple[float, bool, torch.Tensor]],
    expand: Callable[[torch.Tensor], torch.Tensor],
    cfg: WeightQuantConfig,
) -> ScaleResult:
    """Try each (α, duo, s) on `linears` and keep the least output MSE against `reference`.

    `run_loss_module` runs the loss module on the search batches with the linears as they are now;
    `expand` maps a scale vector to the linears' input columns (identity, or repeated per head for
    v→o under grouped-query attention). The linears' weights are restored before returning.
    """
    originals = [lin.weight.data for lin in linears]
    masters = [w.float() for w in originals]

    def loss_of(s: Optional[torch.Tensor]) -> float:
        for lin, w in zip(linears, masters):
            if s is None:
                q = fake_quantize(w, cfg)
            else:
                cols = expand(s).to(w.device)
                q = fake_quantize(w * cols, cfg) / cols
            lin.weight.data = q.to(lin.weight.dtype)
        outs = run_loss_module()
        total = sum(float(torch.nn.functional.mse_loss(o.float(), r.float(), reduction="sum"))
                    for o, r in zip(outs, reference))
        count = sum(r.numel() for r in reference)
        value = total / max(count, 1)
        return value if math.isfinite(value) else math.inf

    try:
        loss_rtn = loss_of(None)
        best = ScaleResult(None, None, None, loss_rtn, loss_rtn)
        for alpha, duo, s in candidates:
            value = loss_of(s)
            best.losses.append(value)
            if value < best.loss:
                best.scales, best.ratio, best.duo, best.loss = s, alpha, duo, value
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    return best


def _group_error(w: torch.Tensor, wq: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """δᵀ C δ per (row, group): [rows, groups] from W, its quantized version and C [groups, gs, gs]."""
    d = (w - wq).reshape(w.shape[0], cov.shape[0], cov.shape[1]).transpose(0, 1)  # [groups, rows, gs]
    return (torch.bmm(d, cov) * d).sum(-1).transpose(0, 1)


@dataclass
class ClipResult:
    max_val: torch.Tensor
    min_val: torch.Tensor
    loss_noclip: float
    loss: float


@torch.no_grad()
def search_clip(
    w: torch.Tensor, cov: torch.Tensor, cfg: WeightQuantConfig, n_grid: int, max_shrink: float,
    asymmetric: bool = True, chunk_elems: int = 1 << 24,
) -> ClipResult:
    """Per (row, group) clip range of W [out, in] minimising δᵀ C δ; C is [groups, gs, gs].

    Shrink ratios run from 1 to `max_shrink` in `n_grid` steps. Symmetric quantization shrinks |max|.
    Asymmetric quantization first shrinks both ends together, then the max alone, then the min alone
    (coordinate steps from the joint optimum), so min and max end up apart where that pays.
    Ratio 1 is always a candidate: no (row, group) ends worse than without clipping.
    """
    w = w.float()
    gs = cov.shape[1]
    ratios = torch.linspace(1.0, max_shrink, max(n_grid, 1), device=w.device).tolist()
    rows_per_chunk = max(1, chunk_elems // w.shape[1])
    max_parts, min_parts, before, after = [], [], 0.0, 0.0
    for r0 in range(0, w.shape[0], rows_per_chunk):
        wc = w[r0 : r0 + rows_per_chunk]
        g = wc.reshape(wc.shape[0], -1, gs)
        base_max = g.abs().amax(-1) if cfg.symmetric else g.amax(-1)
        base_min = -base_max if cfg.symmetric else g.amin(-1)

        def err(mx: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
            return _group_error(wc, fake_quantize(wc, cfg, mx, mn), cov)

        best_err = err(base_max, base_min)
        best_max, best_min = base_max.clone(), base_min.clone()
        before += float(best_err.sum())
        stages = [("both", ratios)]
        if asymmetric and not cfg.symmetric:
            stages += [("max", ratios), ("min", ratios)]
        for which, grid in stages:
            cur_max, cur_min = best_max.clone(), best_min.clone()
            for r in grid[1:] if which == "both" else grid:
                mx = base_max * r if which in ("both", "max") else cur_max
                mn = base_min * r if which in ("both", "min") else cur_min
                e = err(mx, mn)
                better = e < best_err
                best_err = torch.where(better, e, best_err)
                best_max = torch.where(better, mx, best_max)
                best_min = torch.where(better, mn, best_min)
        after += float(best_err.sum())
        max_parts.append(best_max)
        min_parts.append(best_min)
    return ClipResult(torch.cat(max_parts), torch.cat(min_parts), before, after)
