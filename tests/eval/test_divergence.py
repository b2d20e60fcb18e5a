"""eval/divergence.py against float64 math: KL of the next-token distributions and top-1 agreement."""

import pytest
import torch

from quantkit.eval.divergence import Divergence


def test_a_model_against_itself_is_zero_and_agrees_everywhere():
    logits = torch.randn(30, 50, generator=torch.Generator().manual_seed(0)) * 3
    div = Divergence()
    div.add(logits, logits.clone())
    assert div.kl == 0.0 and div.top1 == 1.0 and div.positions == 30


def test_perturbed_model_against_float64():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 40, 64, generator=g) * 3
    other = ref + torch.randn(2, 40, 64, generator=g) * 1.5
    div = Divergence()
    for r, o in zip(ref, other):  # two windows, summed over positions, 7 positions at a time
        div.add(r, o, rows=7)
    p, q = ref.double().log_softmax(-1), other.double().log_softmax(-1)
    want = (p.exp() * (p - q)).sum(-1).mean().item()
    assert div.kl > 0 and div.kl == pytest.approx(want, rel=1e-5)
    agree = (ref.argmax(-1) == other.argmax(-1)).double().mean().item()
    assert div.top1 == pytest.approx(agree) and div.top1 < 1.0
