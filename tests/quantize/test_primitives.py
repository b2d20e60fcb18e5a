"""Quantize/dequantize per group, checked against float64 math written out independently."""

import itertools

import pytest
import torch

from quantkit.config import WeightQuantConfig
from quantkit.quantize.primitives import GroupSizeError, pseudo_quantize, quantize_weight


def float64_reference(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    """Per-group min/max (or absmax) quantization in float64, group by group with plain loops."""
    w = w.double()
    out = torch.empty_like(w)
    gs = w.shape[1] if group_size == -1 else group_size
    qmax = 2**bits - 1
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], gs):
            x = w[r, g0 : g0 + gs]
            if symmetric:
                s = max(x.abs().max().item() / (2 ** (bits - 1) - 1), 1e-8)
                z = 2 ** (bits - 1)
            else:
                mx, mn = max(x.max().item(), 0.0), min(x.min().item(), 0.0)
                s = max((mx - mn) / qmax, 1e-8)
                z = min(max(round(-mn / s), 0), qmax)
            s = float(torch.tensor(s).half().double())  # checkpoints store fp16 scales
            q = torch.clamp(torch.round(x / s) + z, 0, qmax)
            out[r, g0 : g0 + gs] = (q - z) * s
    return out


@pytest.mark.parametrize("bits,group_size,symmetric", list(itertools.product([2, 3, 4, 8], [32, 64, -1], [False, True])))
def test_pseudo_quantize_matches_float64(bits, group_size, symmetric):
    torch.manual_seed(bits * 100 + group_size)
    w = torch.randn(6, 128) * torch.rand(6, 1) * 3
    got = pseudo_quantize(w, WeightQuantConfig(bits, group_size, symmetric)).double()
    ref = float64_reference(w, bits, group_size, symmetric)
    step = (w.abs().max() / 2 ** (bits - 1)).item()
    # Ties at .5 may round either way between float32 and float64: at most a few elements, one step each.
    mismatched = (got - ref).abs() > 1e-5
    assert mismatched.float().mean() < 0.01
    assert (got - ref).abs().max() <= step + 1e-6


def test_integers_in_range_and_error_bounded():
    torch.manual_seed(0)
    w = torch.randn(16, 256)
    qw = quantize_weight(w, WeightQuantConfig(4, 128))
    assert qw.q.min() >= 0 and qw.q.max() <= 15
    assert qw.zeros.min() >= 0 and qw.zeros.max() <= 15
    err = (qw.dequantize() - w).abs()
    # Round to nearest: error at most half a step (plus fp16 rounding of the scale).
    bound = qw.scales.repeat_interleave(128, dim=1) * 0.5 * 1.01 + 1e-6
    assert (err <= bound).all()


def test_more_bits_less_error():
    torch.manual_seed(1)
    w = torch.randn(32, 128)
    errs = [(pseudo_quantize(w, WeightQuantConfig(b, 64)) - w).pow(2).mean().item() for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)


def test_group_size_must_divide():
    with pytest.raises(GroupSizeError):
        quantize_weight(torch.randn(4, 96), WeightQuantConfig(4, 64))
