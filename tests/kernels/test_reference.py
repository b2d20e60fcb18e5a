"""The torch reference kernels against float64 math on random packed weights."""

import torch

from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.kernels import reference


def random_q(out_f, in_f, gs, bits, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.int32)
    z = torch.randint(0, 2**bits, (out_f, in_f // gs), generator=g, dtype=torch.int32)
    s = (torch.rand(out_f, in_f // gs, generator=g) * 0.02 + 0.001).half()
    w64 = (q.double() - z.double().repeat_interleave(gs, 1)) * s.double().repeat_interleave(gs, 1)
    return q, z, s, w64


def test_awq_reference_against_float64():
    q, z, s, w64 = random_q(48, 128, 32, 4, 0)
    t = pack_awq_gemm(q, z, s)
    x = torch.randn(5, 128, dtype=torch.float64)
    y = reference.linear_awq(x.float(), t["qweight"], t["qzeros"], t["scales"], 32)
    y64 = x @ w64.t()
    assert (y.double() - y64).norm() / y64.norm() < 1e-6


def test_packed_reference_against_float64():
    for bits, gs in ((8, 96), (4, 32)):
        q, z, s, w64 = random_q(40, 96, gs, bits, bits)
        t = pack_compressed(q, z, s, bits, symmetric=False)
        x = torch.randn(3, 96, dtype=torch.float64)
        y = reference.linear_packed(x.float(), t["weight_packed"], t["weight_scale"], t["weight_zero_point"], 40, 96, bits, gs)
        y64 = x @ w64.t()
        assert (y.double() - y64).norm() / y64.norm() < 1e-6
