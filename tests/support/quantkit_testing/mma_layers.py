"""Random layers in the mma layout with their dequantized weights, and the integers a layout holds, for the
kernel tests (and bench/lib/kernels_mma.py's reference)."""

from __future__ import annotations

import torch

from quantkit.kernels import triton_mma
from quantkit.kernels.triton_layout import KernelWeights, pack_block_planar
from quantkit.kernels.triton_mma import TILE_K, W4_ORDER


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


def mma_codes(qweight: torch.Tensor, bits: int, k: int, n: int) -> torch.Tensor:
    """The integers int64 [n, k] that mma-layout words hold, each read from the word and bits where
    triton_mma's docstring places it (index arithmetic, not the inverse of `pack_mma`'s reshapes).

    Input i of row r lies in K-tile T = i // 128 with c = i % 128 // 32, t = i % 32 // 8; W4: in row word
    4·t + c of the tile, nibble p with W4_ORDER[p] = i % 8; W8: in row word 8·t + 2·c + h (h = i % 8 // 4),
    byte i % 4. Row word w of thread t = w // wpt (wpt words per thread: 4 for W4, 8 for W8) sits in the
    block of (row tile r // 16, K-tile T), [row half, chunk, lane, word] = [r % 16 // 8, w % wpt // 4,
    4·(r % 8) + t, w % 4]."""
    dev = qweight.device
    wpt = 4 if bits == 4 else 8
    # The layout's size, from the same description: 64·wpt words per (row tile, K-tile); row tiles may be
    # padded past the last one that holds rows.
    tiles, words = -(-n // 16), -(-k // TILE_K) * 64 * wpt
    assert qweight.dtype == torch.int32 and qweight.shape[0] >= tiles and qweight.shape[1] == words, \
        (qweight.dtype, tuple(qweight.shape), (tiles, words))
    r = torch.arange(n, device=dev)[:, None]
    i = torch.arange(k, device=dev)[None, :]
    tile, c, t = i // TILE_K, i % TILE_K // 32, i % 32 // 8
    if bits == 4:
        word = 4 * t + c
        nibble = torch.tensor([W4_ORDER.index(o) for o in range(8)], device=dev)
        shift = 4 * nibble[i % 8]
    else:
        word = 8 * t + 2 * c + i % 8 // 4
        shift = 8 * (i % 4)
    own = word % wpt
    at = tile * 64 * wpt + (r % 16 // 8) * (wpt // 4) * 128 + own // 4 * 128 + (4 * (r % 8) + word // wpt) * 4 + own % 4
    words = qweight[r // 16, at].to(torch.int64) & 0xFFFFFFFF
    return (words >> shift) & ((1 << bits) - 1)
