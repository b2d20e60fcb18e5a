"""The Triton paged prefill kernel (kernels/triton_prefill.py) against the torch reference
(paged_kv.paged_prefill_attention) under TRITON_INTERPRET=1 (see conftest.py).

Sequences packed in one launch: whole prompts, cached prefixes with a few or many new tokens, one new
token, none at all; partial last blocks; random non-contiguous block tables whose unused entries are -1;
fp16 pools whose unused slots hold NaN, and quantized pools whose unused slots have NaN scales.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.kernels import triton_prefill
from quantkit.kernels.paged_kv import paged_prefill_attention
from quantkit_testing.paged_cases import BLOCK, attention64, filled_cache, rel, stored_values

LENS = [37, 21, 50, 9, 16, 33]  # cached tokens per sequence
NEW = [37, 5, 20, 0, 16, 1]  # of which new (queries): whole prompts, cached prefixes, none, one


def nan_scales_outside(cache, tables, lens):
    """A copy of the cache whose scales are NaN in every slot no sequence holds (a kernel that reads one
    fails); the cache itself for bits 16 (its unused slots hold NaN already)."""
    if cache.bits == 16:
        return cache
    used = torch.zeros(cache.num_blocks, cache.kv_heads, cache.block_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        used[tables[b, pos // BLOCK].long(), :, pos % BLOCK] = True
    return dataclasses.replace(cache, k_scale=cache.k_scale.masked_fill(~used, float("nan")),
                               v_scale=cache.v_scale.masked_fill(~used, float("nan")))


CASES = [  # bits, dtype, heads, kv_heads, block_m, block_n
    (16, torch.float16, 4, 2, 16, 16),
    (8, torch.float16, 4, 2, 16, 16),
    (4, torch.float16, 4, 2, 16, 16),
    (16, torch.bfloat16, 2, 2, 16, 32),  # MHA
    (8, torch.bfloat16, 4, 2, 32, 16),
    (4, torch.bfloat16, 8, 1, 16, 16),  # a group of 8: two queries per tile
    (8, torch.float16, 6, 2, 16, 16),  # a group of 3: five queries per tile and one padding row
    (16, torch.float32, 4, 2, 16, 16),
    (4, torch.float16, 4, 2, 64, 64),  # the default tiles
]


# Relative error allowed against the reference; against float64 math, half of it (the kernel dequantizes
# nothing to the model's dtype, so it is closer to float64 than the reference, which does).
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 6e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("bits,dtype,heads,kv_heads,block_m,block_n", CASES)
def test_triton_prefill_attention(monkeypatch, triton_interpreter, bits, dtype, heads, kv_heads, block_m, block_n):
    cache, tables, ks, vs = filled_cache(LENS, kv_heads, 64, bits, dtype, seed=bits + heads)
    ctx = torch.tensor(LENS, dtype=torch.int32)
    start = torch.tensor([0, *torch.tensor(NEW).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(heads)
    # q a view of a fused qkv output: rows strided by heads + 2 kv_heads
    qkv = (torch.randn(sum(NEW), heads + 2 * kv_heads, 64, generator=g) * 2).to(dtype)
    q = qkv[:, :heads]
    ref = paged_prefill_attention(q, cache, tables, ctx, start, 0.125)
    out = triton_prefill.paged_prefill_attention(q, nan_scales_outside(cache, tables, LENS), tables, ctx, start, 0.125,
                                                 block_m=block_m, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    for b, (length, n) in enumerate(zip(LENS, NEW)):
        s, e = start[b], start[b + 1]
        if n:
            assert rel(out[s:e], ref[s:e]) < tol, b
            k, v = (stored_values(x[b].float(), bits) for x in (ks, vs))
            assert rel(out[s:e], attention64(q[s:e], k, v, 0.125, causal_offset=length - n)) < tol / 2, b


def test_triton_prefill_without_queries(triton_interpreter):
    """No sequence with a query (or no sequence at all): an empty output, no launch."""
    cache, tables, _, _ = filled_cache([5, 3], 1, 64, 8, torch.float16)
    ctx = torch.tensor([5, 3], dtype=torch.int32)
    q = torch.randn(0, 2, 64).half()
    out = triton_prefill.paged_prefill_attention(q, nan_scales_outside(cache, tables, [5, 3]), tables, ctx,
                                                 torch.zeros(3, dtype=torch.int32), 0.125)
    assert out.shape == (0, 2, 64)
