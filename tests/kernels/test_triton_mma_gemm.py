"""The tensor-core GEMM on the mma layout, under TRITON_INTERPRET on the CPU (small shapes)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import triton_mma_gemm as tg
from mma_layers import random_layer


@pytest.mark.parametrize("bits,m,k,n,gs,bf16,bn,bm,bias", [
    (4, 17, 256, 40, 128, False, 16, 16, True),    # rows of x and W past the tiles, bias
    (4, 5, 200, 70, 128, False, 32, 16, False),    # K not a multiple of 128, N past the padded rows
    (4, 33, 384, 24, 256, True, 16, 32, False),    # bf16, a group of two K-tiles
    (8, 20, 320, 33, 320, False, 16, 16, True),    # W8, one group per row (per channel)
    (8, 9, 256, 16, 128, False, 16, 16, False),    # W8 g128
])
def test_gemm_matches_the_dequantized_weights(triton_interpreter, bits, m, k, n, gs, bf16, bn, bm, bias):
    mw, _, w = random_layer(n, k, bits, gs, seed=m + n)
    dtype = torch.bfloat16 if bf16 else torch.float16
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = tg.gemm(x, mw, b, block_n=bn, block_m=bm, num_warps=1, num_stages=1, out=out)
    ref = x.float() @ w.t() + (b.float() if bias else 0)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_gemm_rejects_mismatched_inputs():
    mw, _, _ = random_layer(16, 256, 4, 128)
    with pytest.raises(ValueError, match="inputs"):
        tg.gemm(torch.randn(3, 128).half(), mw)
