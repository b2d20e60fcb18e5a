"""Repacking in row chunks (triton_layout.ROW_CHUNK) gives the same words as repacking whole layers, and
those words hold the layer's integers (read back independently of the packing code)."""

from __future__ import annotations

import pytest
import torch
from quantkit_testing.mma_layers import mma_codes

from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.kernels import triton_layout, triton_mma


def _layer(bits: int, n: int, k: int, gs: int):
    g = torch.Generator().manual_seed(n + bits)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(0, 2**bits, (n, k // gs), generator=g, dtype=torch.int32)
    s = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.002).half()
    return q, z, s


@pytest.mark.parametrize("fmt,bits", [("awq", 4), ("packed", 4), ("packed", 8)])
def test_row_chunks_match_whole_layers(monkeypatch, fmt, bits):
    n, k, gs = 200, 256, 128  # 200 rows: three whole chunks of 64 and a part of one
    q, z, s = _layer(bits, n, k, gs)

    def repack():
        if fmt == "awq":
            t = pack_awq_gemm(q, z, s)
            kw = triton_layout.from_awq(t["qweight"], t["qzeros"], t["scales"], gs)
        else:
            t = pack_compressed(q, z, s, bits, symmetric=False)
            kw = triton_layout.from_packed(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), n, k,
                                           bits, gs)
        return kw, triton_mma.from_kernel_weights(kw)

    whole_kw, whole_mw = repack()  # ROW_CHUNK (1024) > n: one chunk
    monkeypatch.setattr(triton_layout, "ROW_CHUNK", 64)
    kw, mw = repack()
    assert torch.equal(kw.qweight, whole_kw.qweight)
    assert torch.equal(mw.qweight, whole_mw.qweight)
    assert torch.equal(triton_layout.unpack_block_planar(kw.qweight, bits, k), q)
    assert torch.equal(mma_codes(mw.qweight, bits, k, n), q.to(torch.int64))
