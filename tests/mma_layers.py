"""Random layers in the mma layout with their dequantized weights, for the kernel tests."""

from __future__ import annotations

import torch

from quantkit.kernels import triton_mma
from quantkit.kernels.triton_layout import KernelWeights, pack_block_planar


def random_layer(n: int, k: int, bits: int = 4, group_size: int = 128, seed: int = 0):
    """(mma weights, integers q [n, k], W = (q − z)·s fp32 [n, k], the generator after drawing them) of a
    random layer; group_size −1: one group per row."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    s = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    z = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    mw = triton_mma.from_kernel_weights(KernelWeights(pack_block_planar(q, bits), s, z, bits, gs, k, n))
    idx = torch.arange(k) // gs
    return mw, q, (q.float() - z.float()[:, idx]) * s.float()[:, idx], g
