"""Fp8Linear: checkpoint tensors load straight in; forward is the FP8 GEMM's arithmetic — activations rounded
onto the e4m3 grid per token (dynamic) or under input_scale (static), times the dequantized weight —
checked against float64 math written here, not against the reference it runs."""

import pytest
import torch

from quantkit.formats.fp8 import encode_e4m3, pack_fp8
from quantkit.kernels import reference
from quantkit.nn import Fp8Linear


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (float64, |v| ≤ 448) to the nearest e4m3 value, ties to even: spacing 2^(e−3), 2^−9 below 2^−6."""
    step = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))) - 3)
    return torch.round(v / step) * step  # torch.round: half to even


def oracle(x, w, w_scale, input_scale, bias):
    x, w = x.double(), w.float().double() * w_scale.double().reshape(-1, 1)
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1 / (448 * 512)) / 448 if input_scale is None else input_scale.double()
    xq = round_e4m3((x / s).clamp(-448, 448)) * s
    return xq @ w.t() + bias.double()


def build(activations, per_tensor):
    torch.manual_seed(3)
    w = torch.randn(24, 48)
    scale = w.abs().amax().reshape(1) / 448 if per_tensor else w.abs().amax(dim=1, keepdim=True) / 448
    tensors = pack_fp8(encode_e4m3(w, scale), scale,
                       torch.tensor([0.02]) if activations == "static" else None)
    m = Fp8Linear(48, 24, activations, per_tensor=per_tensor, bias=True)
    m.load_state_dict({**tensors, "bias": torch.randn(24).half()}, strict=True)
    return m, tensors


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_forward_is_the_fp8_gemm(activations, per_tensor, cached):
    m, t = build(activations, per_tensor)
    m.cache_dequantized = cached
    x = torch.randn(3, 5, 48) * torch.rand(3, 5, 1) * 4  # tokens of different ranges
    x[0, 0] = 0  # an all-zero token: the floor on its scale, no NaN
    want = oracle(x, t["weight"], t["weight_scale"], t.get("input_scale"), m.bias)
    for _ in range(2):  # the second call reads the cache when there is one
        got = m(x)
        assert got.dtype == x.dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (m._cached_weight is not None) == cached and "_cached_weight" not in m.state_dict()
    # The activations are quantized: a plain matmul with the dequantized weight differs.
    plain = x @ m.dequantized_weight().t() + m.bias.float()
    assert (m(x) - plain).abs().max() > 1e-3


def test_static_saturates_past_the_input_scale():
    m, _ = build("static", False)
    x = torch.full((1, 48), 100.0)  # far past 448 · 0.02 = 8.96: every input saturates at it
    torch.testing.assert_close(m(x), torch.full((1, 48), 448 * 0.02) @ m.dequantized_weight().t() + m.bias.float())


def test_reference_dequantizes_both_scale_shapes():
    w = torch.randn(4, 8)
    q = encode_e4m3(w, torch.tensor([0.01]))
    assert torch.equal(reference.dequantize_fp8(q, torch.tensor([0.01])), q.float() * 0.01)
    s = torch.rand(4, 1)
    assert torch.equal(reference.dequantize_fp8(q, s), q.float() * s)
