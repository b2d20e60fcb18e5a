"""Random layers in the mma layout with their dequantized weights, for the kernel tests."""

from __future__ import annotations

import torch

from quantkit.kernels import triton_mma as tm
from quantkit.kernels.triton_layout import KernelWeights, pack_block_planar


def random_layer(n: int, k: int, bits: int, gs: int, seed: int = 0):
    """(mma weights, integers q [n, k], W = (q − z)·s fp32) of a random layer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    groups = -(-k // gs)
    s = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
    z = torch.randint(0, 2**bits, (n, groups), generator=g).to(torch.uint8)
    kw = KernelWeights(pack_block_planar(q, bits), s, z, bits, gs, k, n)
    idx = torch.arange(k) // gs
    w = (q.float() - z.float()[:, idx]) * s.float()[:, idx]
    return tm.from_kernel_weights(kw), q, w
