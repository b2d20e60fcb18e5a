"""The paged KV cache's test cases: a filled pool with random non-contiguous block tables, what it should
read back, and attention in float64 (tests/kernels: the reference, the Triton kernels, the rows kernel)."""

from __future__ import annotations

import math

import torch

from quantkit.kernels.paged_kv import PagedKV, quantize_per_token, write_kv

BLOCK = 16


def filled_cache(lens, kv_heads, head_dim, bits, dtype, seed=0, spare_blocks=5):
    """(cache, block_tables [B, max_blocks] int32, the K and V written per sequence [len, kv_heads, D]).

    Each sequence gets a random, non-contiguous set of blocks; unused table entries are -1 (garbage the
    kernels must not follow). Every token is written in one call, in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / BLOCK) for n in lens]
    num_blocks = sum(need) + spare_blocks
    cache = PagedKV.allocate(num_blocks, BLOCK, kv_heads, head_dim, bits, dtype, "cpu")
    if bits == 16 and dtype.is_floating_point:
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.int32)
    ks, vs, slots = [], [], []
    used = 0
    for b, n in enumerate(lens):
        blocks = perm[used:used + need[b]]
        used += need[b]
        tables[b, : need[b]] = blocks.int()
        pos = torch.arange(n)
        slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        ks.append(torch.randn(n, kv_heads, head_dim, generator=g).to(dtype))
        vs.append(torch.randn(n, kv_heads, head_dim, generator=g).to(dtype))
    order = torch.randperm(sum(lens), generator=g)
    write_kv(cache, torch.cat(ks)[order], torch.cat(vs)[order], torch.cat(slots)[order])
    return cache, tables, ks, vs


def stored_values(x, bits):
    """What the cache should read back for x: its per-token codes decoded in float64."""
    if bits == 16:
        return x.double()
    q, s, z = quantize_per_token(x, bits)
    return (q.double() - z.double()[..., None]) * s.double()[..., None]


def attention64(q, k, v, sm_scale, causal_offset=None):
    """softmax(q kᵀ · scale) v in float64 for q [n, H, D], k, v [L, kv_heads, D] (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * sm_scale
    if causal_offset is not None:
        n, length = q.shape[0], k.shape[0]
        allowed = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + causal_offset
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def rel(out, ref):
    assert torch.isfinite(out).all(), "output holds NaN/Inf"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
