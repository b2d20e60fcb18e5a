"""AWQ's two searches measured on planted structure, by output errors the tests compute themselves.

Scale search: a norm feeding two linears, the norm's weight making a few input channels 30x louder
(the salient channels AWQ is about). Clip search: a planted large weight in every group, on an input
channel that is quiet (clipping it costs little) or loud (clipping it costs much). Each test checks
the error on held-out activations through `quantize_weight`, the checkpoint's rounding, not the
search's own loss, and what the search chose (α, which channels, which groups it clipped).
"""

from __future__ import annotations

import pytest
import torch

from quantkit.config import WeightQuantConfig
from quantkit.quantize.folding import fold_scales, identity
from quantkit.quantize.primitives import quantize_weight
from quantkit.quantize.search import candidate_scales, search_clip, search_scales, weight_magnitude

W4G32 = WeightQuantConfig(4, 32)
HIDDEN, OUT, TOKENS, LOUD = 128, 96, 512, (7, 40, 77, 101)


def norm_group(seed: int):
    """(RMSNorm whose weight makes channels LOUD 30x larger, two linears it feeds, search x, held-out x)."""
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
    linears = [torch.nn.Linear(HIDDEN, OUT, bias=False) for _ in range(2)]
    with torch.no_grad():
        norm.weight.copy_(torch.rand(HIDDEN, generator=g) + 0.5)
        norm.weight[list(LOUD)] *= 30.0
        for lin in linears:
            lin.weight.copy_(torch.randn(OUT, HIDDEN, generator=g) * 0.05)
    x = torch.randn(2 * TOKENS, HIDDEN, generator=g)
    return norm, linears, x[:TOKENS], x[TOKENS:]


def output_error(norm, linears, x: torch.Tensor, reference: list[torch.Tensor]) -> float:
    """Σ‖norm(x) Q(W)ᵀ − reference‖² over the linears, Q being the checkpoint's rounding of W as it is now."""
    with torch.no_grad():
        h = norm(x)
        return sum(float((h @ quantize_weight(lin.weight, W4G32).dequantize().t() - r).pow(2).sum())
                   for lin, r in zip(linears, reference))


@pytest.mark.parametrize("duo", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_scale_search_cuts_output_error_on_loud_channels(seed, duo):
    norm, linears, x_search, x_heldout = norm_group(seed)
    with torch.no_grad():
        reference = [lin(norm(x_heldout)) for lin in linears]
        h = norm(x_search)
        search_reference = [lin(h) for lin in linears]
    rtn_error = output_error(norm, linears, x_heldout, reference)

    w_mean = weight_magnitude([lin.weight for lin in linears], W4G32.group_size) if duo else None
    candidates = [(a, duo, s) for a, s in candidate_scales(h.abs().mean(0), w_mean, n_grid=20)]
    result = search_scales(linears, lambda: [lin(h) for lin in linears], search_reference, candidates, identity, W4G32)
    assert result.scales is not None and result.ratio > 0
    # The largest scales sit on the planted channels: the search found what makes them salient.
    assert set(result.scales.topk(len(LOUD)).indices.tolist()) == set(LOUD)

    fold_scales(norm, linears, result.scales, result.scales)  # what awq.py does with the winner
    awq_error = output_error(norm, linears, x_heldout, reference)
    # Measured 0.20-0.26 of RTN's error over these seeds; an α = 0 (ones) search gives 1.0.
    assert awq_error < 0.5 * rtn_error, (awq_error, rtn_error, result.ratio)


GS = 32


def planted_layer(seed: int, channel_gain: float):
    """W [64, 128] with a weight of 8 (≈ 8σ) at input 5 of every group, and activations whose inputs 5,
    37, … carry `channel_gain` times the others' magnitude: (W, Gram per group, held-out x, outlier cols)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 128, generator=g)
    cols = torch.arange(128 // GS) * GS + 5
    w[:, cols] = 8.0
    gain = torch.ones(128)
    gain[cols] = channel_gain
    x_search, x_heldout = torch.randn(1024, 128, generator=g) * gain, torch.randn(1024, 128, generator=g) * gain
    xg = x_search.reshape(-1, 128 // GS, GS)
    return w, torch.einsum("tgi,tgj->gij", xg, xg), x_heldout, cols


def clip_errors(w, gram, x, symmetric: bool):
    """(search result, held-out output error with the searched range, without clipping)."""
    cfg = WeightQuantConfig(4, GS, symmetric)
    res = search_clip(w, gram, cfg, n_grid=20, max_shrink=0.5)

    def err(wq: torch.Tensor) -> float:
        return float((x @ (w - wq).t()).pow(2).sum())

    clipped = err(quantize_weight(w, cfg, res.max_val, res.min_val).dequantize())
    return res, clipped, err(quantize_weight(w, cfg).dequantize())


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_search_clips_outliers_on_quiet_inputs(symmetric):
    """A planted outlier weight whose input is quiet costs little to clip, and clipping it refines the
    grid of the other 31 weights of its group: the search should shrink every group's range."""
    w, gram, x, _ = planted_layer(0, channel_gain=0.05)
    res, clipped, unclipped = clip_errors(w, gram, x, symmetric)
    shrink = res.max_val.abs() / 8.0  # the outlier is each group's max
    assert shrink.max() < 1 and shrink.mean() < 0.7, shrink
    # Measured 0.43 (asymmetric) and 0.26 (symmetric); min/max gives 1.0.
    assert clipped < 0.6 * unclipped, (clipped, unclipped)


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_search_keeps_outliers_on_loud_inputs(symmetric):
    """The same weights with the outliers' input 5x louder than the rest: clipping them would cost more
    than it saves, and the search, which weighs errors by the inputs' Gram matrix, keeps them."""
    w, gram, x, _ = planted_layer(0, channel_gain=5.0)
    res, clipped, unclipped = clip_errors(w, gram, x, symmetric)
    assert (res.max_val.abs() >= 0.9 * 8.0).all(), res.max_val
    assert clipped <= unclipped * 1.001
