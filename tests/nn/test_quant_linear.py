"""QuantLinear: buffers named as the checkpoint's tensors; forward equals the dequantized matmul, cached or not."""

import pytest
import torch

from quantkit.config import WeightQuantConfig
from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.nn import QuantLinear
from quantkit.quantize.primitives import quantize_weight


def build(layout, bits, gs, symmetric=False):
    torch.manual_seed(bits + gs)
    w = torch.randn(40, 64)
    qw = quantize_weight(w, WeightQuantConfig(bits, gs, symmetric))
    if layout == "awq":
        tensors = pack_awq_gemm(qw.q, qw.zeros, qw.scales)
    else:
        tensors = pack_compressed(qw.q, qw.zeros, qw.scales, bits, symmetric)
    m = QuantLinear(64, 40, bits, gs, layout=layout, symmetric=symmetric, bias=True)
    m.load_state_dict({**tensors, "bias": torch.randn(40).half()}, strict=True)
    return m, qw


@pytest.mark.parametrize("layout,bits,gs,sym", [("awq", 4, 32, False), ("packed", 8, 64, True), ("packed", 4, 16, False)])
@pytest.mark.parametrize("cached", [False, True])
def test_forward_matches_dequantized_matmul(layout, bits, gs, sym, cached):
    m, qw = build(layout, bits, gs, sym)
    m.cache_dequantized = cached
    x = torch.randn(3, 5, 64)
    want = x @ qw.dequantize().t() + m.bias.float()
    for _ in range(2):  # the second call reads the cache when there is one
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    assert (m._cached_weight is not None) == cached
    assert "_cached_weight" not in m.state_dict()
