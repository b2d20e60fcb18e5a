"""The decode kernel without tl.dot (kernels/triton_paged_rows.py) under TRITON_INTERPRET=1: against float64
attention over what the cache stores, the torch reference (kernels/paged_kv.py) and decode_kernel, and
the choice between the two kernels (triton_paged.decode_variant).

Contexts of 0 to several tiles with partial last blocks, random non-contiguous block tables, NaN in the
unused slots of fp16/bf16 pools (quantkit_testing.paged_cases.filled_cache), one to four query heads per kv head.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quantkit.kernels import triton_paged
from quantkit.kernels.paged_kv import paged_decode_attention
from quantkit.kernels.settings import KernelSettings
from quantkit_testing.paged_cases import attention64, filled_cache, stored_values

CASES = [  # bits, dtype, heads, kv_heads, head_dim, partitions (None: num_partitions), block_n
    (16, torch.float16, 2, 2, 64, None, 64),
    (8, torch.float16, 2, 2, 64, None, 64),
    (4, torch.float16, 2, 2, 64, None, 64),
    (16, torch.bfloat16, 2, 2, 64, 1, 16),
    (8, torch.bfloat16, 2, 2, 64, 3, 16),
    (4, torch.bfloat16, 2, 2, 64, 5, 16),
    (4, torch.float16, 4, 2, 64, 1, 32),
    (8, torch.float16, 4, 2, 64, 3, 16),
    (16, torch.float16, 8, 2, 64, 2, 16),
    (4, torch.bfloat16, 8, 2, 64, None, 32),
    (4, torch.float16, 3, 3, 80, 2, 16),  # head_dim 80: each half padded from 40 to 64 lanes
]


def decode(q, cache, tables, ctx, kernel, partitions, block_n):
    return triton_paged.paged_decode_attention(q, cache, tables, ctx, 0.125, partitions=partitions, block_n=block_n,
                                               kernel=kernel)


@pytest.mark.parametrize("bits,dtype,heads,kv_heads,head_dim,partitions,block_n", CASES)
def test_rows_kernel_is_attention_over_the_stored_values(monkeypatch, triton_interpreter, bits, dtype, heads,
                                                         kv_heads, head_dim, partitions, block_n):
    """Products in fp32 and codes dequantized exactly: within the output dtype's rounding of float64
    attention over the decoded cache (decode_kernel's fp16/bf16 p is not that close). An empty context
    gives 0, from both kernels."""
    lens = [1, 16, 37, 70, 0, 5]
    cache, tables, ks, vs = filled_cache(lens, kv_heads, head_dim, bits, dtype, seed=bits + heads)
    ctx = torch.tensor(lens, dtype=torch.int32)
    g = torch.Generator().manual_seed(heads)
    q = (torch.randn(len(lens), heads, head_dim + 32, generator=g)[..., :head_dim] * 2).to(dtype)  # strided rows
    rows = decode(q, cache, tables, ctx, "rows", partitions, block_n)
    dot = decode(q, cache, tables, ctx, "dot", partitions, block_n)
    assert torch.isfinite(rows).all()
    eps = torch.finfo(dtype).eps
    for b, n in enumerate(lens):
        if n == 0:
            assert (rows[b] == 0).all() and (dot[b] == 0).all()
            continue
        want = attention64(q[b:b + 1], stored_values(ks[b], bits), stored_values(vs[b], bits), 0.125)[0]
        assert ((rows[b].double() - want).abs() <= want.abs() * eps + 1e-5).all(), b
    live = torch.tensor(lens) > 0
    ref = paged_decode_attention(q[live], cache, tables[live], ctx[live], 0.125)
    for out in (rows, dot):
        err = ((out[live].double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < 4e-3


def test_rows_kernel_serves_the_dispatch_when_asked(triton_interpreter):
    """A pool whose settings ask for "rows" sends groups of ≤ 4 query heads to the rows kernel, larger ones
    to decode_kernel; by default these groups (GQA) go to decode_kernel."""
    lens = [9, 40]
    cache, tables, _, _ = filled_cache(lens, 1, 64, 4, torch.float16, seed=3)  # written by the reference
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)).half()
    by_default = dataclasses.replace(cache, kernels=KernelSettings(path="triton"))
    rows_asked = dataclasses.replace(cache, kernels=KernelSettings.from_env({"QUANTKIT_KERNEL": "triton",
                                                                             "QUANTKIT_DECODE_KERNEL": "rows"}))
    for heads, variant in ((4, "rows"), (8, "dot")):
        qh = q[:, :heads]
        default = paged_decode_attention(qh, by_default, tables, ctx, 0.125)
        asked = paged_decode_attention(qh, rows_asked, tables, ctx, 0.125)
        assert torch.equal(default, triton_paged.paged_decode_attention(qh, cache, tables, ctx, 0.125, kernel="dot"))
        assert torch.equal(asked, triton_paged.paged_decode_attention(qh, cache, tables, ctx, 0.125, kernel=variant))


def test_decode_variant_rule():
    """"auto": rows for MHA over int8/int4 codes only (where it measured faster); the pool's preference or
    the argument overrides; a group too large for rows is refused when asked for by name."""
    assert [triton_paged.decode_variant(1, bits) for bits in (16, 8, 4)] == ["dot", "rows", "rows"]
    assert [triton_paged.decode_variant(g, 4) for g in (2, 4, 8)] == ["dot", "dot", "dot"]
    assert triton_paged.decode_variant(1, 4, preferred="dot") == "dot"
    assert [triton_paged.decode_variant(g, 16, preferred="rows") for g in (1, 4, 8)] == ["rows", "rows", "dot"]
    assert triton_paged.decode_variant(8, 4, "dot") == "dot"
    with pytest.raises(ValueError, match="at most 4"):
        triton_paged.decode_variant(8, 4, "rows")
    with pytest.raises(ValueError, match="choose 'dot' or 'rows'"):
        triton_paged.decode_variant(1, 4, "tensor")
