"""The torch reference (dequantized weights) against float64 math on random packed weights."""

import pytest
import torch

from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.kernels import reference


def random_q(out_f, in_f, gs, bits, seed, symmetric=False):
    """Random integers, zeros (2^(b−1) when symmetric) and fp16 scales, and W = (q − z) · s in float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.int32)
    z = torch.randint(0, 2**bits, (out_f, in_f // gs), generator=g, dtype=torch.int32)
    if symmetric:
        z.fill_(2 ** (bits - 1))
    s = (torch.rand(out_f, in_f // gs, generator=g) * 0.02 + 0.001).half()
    w64 = (q.double() - z.double().repeat_interleave(gs, 1)) * s.double().repeat_interleave(gs, 1)
    return q, z, s, w64


def assert_float32_of(w, w64):
    """w is W in float32: each element the float64 value rounded once (q − z is exact, s an fp16 value)."""
    assert w.dtype == torch.float32 and w.shape == w64.shape
    assert torch.equal(w, w64.float())


def test_awq_reference_against_float64():
    q, z, s, w64 = random_q(48, 128, 32, 4, 0)
    t = pack_awq_gemm(q, z, s)
    assert_float32_of(reference.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], 32), w64)


@pytest.mark.parametrize("bits,gs,symmetric", [(8, 96, False), (4, 32, False), (4, 32, True), (8, 48, True)])
def test_packed_reference_against_float64(bits, gs, symmetric):
    q, z, s, w64 = random_q(40, 96, gs, bits, bits + gs, symmetric)
    t = pack_compressed(q, z, s, bits, symmetric=symmetric)
    assert ("weight_zero_point" in t) != symmetric
    w = reference.dequantize_packed(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), 40, 96, bits, gs)
    assert_float32_of(w, w64)
