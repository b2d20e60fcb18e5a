"""The paged KV cache's torch reference (quantkit's one KV codec) against float64 math; the Triton kernels
(kernels/triton_paged.py) against the reference under TRITON_INTERPRET=1 (see conftest.py).

Random K/V/Q (never zeros), contexts of different lengths with partial last blocks, random
non-contiguous block tables, GQA, and a pool whose unused slots hold NaN codes where the dtype allows
(a kernel that reads past a context then fails).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from quantkit.config import UserError
from quantkit.kernels import triton_paged
from quantkit.kernels.paged_kv import (QMAX, PagedKV, gather_kv, pack_int4, paged_decode_attention,
                                       paged_prefill_attention, quantize_per_token, static_scales, write_kv)
from quantkit.kernels.settings import KernelSettings
from quantkit_testing.paged_cases import BLOCK, attention64, filled_cache, rel, stored_values


def pack(q, bits):
    return pack_int4(q) if bits == 4 else q


# ---- layout

def test_bytes_per_token_is_what_allocate_takes():
    for bits in (16, 8, 4):
        cache = PagedKV.allocate(3, BLOCK, 2, 64, bits, torch.float16, "cpu")
        tensors = [cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero]
        total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        assert total == 3 * BLOCK * PagedKV.bytes_per_token(2, 64, bits, torch.float16)
        assert cache.head_dim == 64 and cache.kv_heads == 2 and cache.block_size == BLOCK


def test_capacity_ratios_at_head_dim_128():
    """The issue's targets: KV8 ≥ 1.9× and KV4 ≥ 3.4× the tokens of fp16 KV in the same memory."""
    fp16 = PagedKV.bytes_per_token(8, 128, 16, torch.float16)
    assert fp16 / PagedKV.bytes_per_token(8, 128, 8, torch.float16) >= 1.9
    assert fp16 / PagedKV.bytes_per_token(8, 128, 4, torch.float16) >= 3.4


def test_bad_bits_are_user_errors():
    with pytest.raises(UserError, match="--kv-bits 3"):
        PagedKV.allocate(1, BLOCK, 1, 64, 3, torch.float16, "cpu")
    with pytest.raises(UserError, match="odd"):
        PagedKV.bytes_per_token(1, 63, 4, torch.float16)


# ---- reference: write, gather

@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_codes_against_float64(bits):
    """Per row: the scale is an fp16 value just above range / qmax (range = [min(x, 0), max(x, 0)]), the zero
    the integer code of 0, the codes round(x / s) + z; decoded, every value is within half a step."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 5
    x[7, 1] = x[7, 1].abs() + 0.1  # no negative value: the range starts at 0
    q, s, z = quantize_per_token(x, bits)
    x64 = x.double()
    lo, hi = x64.amin(-1).clamp(max=0), x64.amax(-1).clamp(min=0)
    exact = (hi - lo) / QMAX[bits]
    s64, z64 = s.double(), z.double()
    assert s.dtype == torch.float16 and ((s64 >= exact) & (s64 <= exact * (1 + 2 ** -8))).all()
    assert torch.equal(z64, torch.round(-lo / s64)) and z64[7, 1] == 0
    want = (torch.round(x64 / s64[..., None]) + z64[..., None]).clamp(0, QMAX[bits])
    assert torch.equal(q.double(), want)
    back = (q.double() - z64[..., None]) * s64[..., None]
    assert ((back - x64).abs() <= s64[..., None] * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantized_write_stores_per_token_codes(bits, dtype):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(40, 2, 64, generator=g) * torch.rand(40, 2, 1, generator=g) * 4).to(dtype)
    v = (torch.randn(40, 2, 64, generator=g) + 0.5).to(dtype)  # mostly positive rows: zero near the bottom
    k[3, 1] = k[3, 1].abs()  # a row with no negative value: zero code 0
    cache = PagedKV.allocate(4, BLOCK, 2, 64, bits, dtype, "cpu")
    slots = torch.randperm(4 * BLOCK, generator=g)[:40]
    write_kv(cache, k, v, slots)
    for x, codes, scale, zero in ((k, *cache.by_slot("k")), (v, *cache.by_slot("v"))):
        q, s, z = quantize_per_token(x, bits)
        stored = codes.reshape(-1, 2, codes.shape[-1])[slots]
        assert torch.equal(stored, pack(q, bits))
        assert torch.equal(scale.reshape(-1, 2)[slots], s)
        assert torch.equal(zero.reshape(-1, 2)[slots], z)


def test_negative_slots_are_skipped():
    cache = PagedKV.allocate(2, BLOCK, 1, 64, 8, torch.float16, "cpu")
    k = torch.randn(3, 1, 64).half()
    write_kv(cache, k, k, torch.tensor([5, -1, 7]))
    assert (cache.k_scale.view(-1)[[5, 7]] > 0).all()
    others = [i for i in range(2 * BLOCK) if i not in (5, 7)]  # one kv head: slot order is the pool's
    assert (cache.k.view(-1, 64)[others] == 0).all() and (cache.k_scale.view(-1)[others] == 0).all()


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_gather_reads_back_what_was_written(bits):
    lens = [37, 16, 5]
    cache, tables, ks, vs = filled_cache(lens, 2, 64, bits, torch.float32)
    for b, n in enumerate(lens):
        k, v = gather_kv(cache, tables[b], n, torch.float32)
        assert k.shape == (n, 2, 64)
        torch.testing.assert_close(k.double(), stored_values(ks[b], bits), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v.double(), stored_values(vs[b], bits), rtol=1e-6, atol=1e-6)
        if bits != 16:  # and the codes are within half a step (plus the fp16 scale's rounding) of the input
            step = (ks[b].amax(-1) - ks[b].amin(-1).clamp(max=0)).clamp(min=0) / QMAX[bits]
            assert ((k - ks[b]).abs() <= step[..., None] * 0.51 + 1e-6).all()


# ---- reference: attention against float64 math

@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_decode_attention_matches_float64(bits, heads, kv_heads):
    lens = [1, 16, 33, 50]
    cache, tables, ks, vs = filled_cache(lens, kv_heads, 64, bits, torch.float32)
    q = torch.randn(len(lens), heads, 64)
    out = paged_decode_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    for b in range(len(lens)):
        want = attention64(q[b:b + 1], stored_values(ks[b], bits), stored_values(vs[b], bits), 0.125)[0]
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [16, 8])
def test_prefill_attention_matches_float64(bits):
    """Three sequences packed: a whole prompt, a cached prefix + 7 new tokens, a single new token."""
    lens, new = [21, 40, 9], [21, 7, 1]
    cache, tables, ks, vs = filled_cache(lens, 2, 64, bits, torch.float32, seed=3)
    q = torch.randn(sum(new), 4, 64)
    start = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_prefill_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32), start, 0.125)
    for b, (n, m) in enumerate(zip(lens, new)):
        qb = q[start[b]:start[b + 1]]
        want = attention64(qb, stored_values(ks[b], bits), stored_values(vs[b], bits), 0.125, causal_offset=n - m)
        torch.testing.assert_close(out[start[b]:start[b + 1]].double(), want, rtol=1e-5, atol=1e-5)


def test_decode_equals_prefill_of_one_token():
    lens = [19, 48]
    cache, tables, _, _ = filled_cache(lens, 2, 64, 8, torch.float32, seed=5)
    q = torch.randn(2, 4, 64)
    ctx = torch.tensor(lens, dtype=torch.int32)
    decode = paged_decode_attention(q, cache, tables, ctx, 0.1)
    prefill = paged_prefill_attention(q, cache, tables, ctx, torch.tensor([0, 1, 2], dtype=torch.int32), 0.1)
    torch.testing.assert_close(decode, prefill, rtol=1e-5, atol=1e-5)


# ---- Triton kernels against the reference (interpreted)

@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_write_equals_reference(monkeypatch, triton_interpreter, bits, dtype):
    """Same codes, scales and zeros byte for byte; k and v as views of one fused qkv output; slot -1 skipped."""
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(23, 8, 64, generator=g) * torch.rand(23, 8, 1, generator=g) * 3).to(dtype)
    qkv[4, 4] = qkv[4, 4].abs()  # a row with no negative value
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # q would be qkv[:, :4]: non-contiguous views
    slots = torch.randperm(5 * BLOCK, generator=g)[:23]
    slots[[3, 11]] = -1
    caches = []
    for path in ("reference", "triton"):
        cache = PagedKV.allocate(5, BLOCK, 2, 64, bits, dtype, "cpu", kernels=KernelSettings(path=path))
        write_kv(cache, k, v, slots)
        caches.append(cache)
    ref, tri = caches
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        if getattr(ref, name) is not None:
            assert torch.equal(getattr(tri, name), getattr(ref, name)), name
    assert ref.k.flatten().float().abs().sum() > 0


DECODE_CASES = [  # bits, dtype, heads, kv_heads, partitions (None: num_partitions), block_n
    (16, torch.float16, 4, 2, None, 64),
    (8, torch.float16, 4, 2, None, 64),
    (4, torch.float16, 4, 2, None, 64),
    (16, torch.bfloat16, 4, 2, 1, 16),
    (8, torch.bfloat16, 4, 2, 3, 16),
    (4, torch.float16, 4, 2, 1, 32),
    (8, torch.float16, 2, 2, 5, 16),
    (4, torch.float16, 8, 1, 2, 16),
]


@pytest.mark.parametrize("bits,dtype,heads,kv_heads,partitions,block_n", DECODE_CASES)
def test_triton_decode_attention(monkeypatch, triton_interpreter, bits, dtype, heads, kv_heads, partitions, block_n):
    """Contexts of 1 token to several tiles, partial last blocks, random block tables; a kernel split
    into more partitions than a short context has tiles leaves those partitions empty."""
    lens = [1, 16, 37, 70, 5]
    cache, tables, _, _ = filled_cache(lens, kv_heads, 64, bits, dtype, seed=bits + heads)  # the reference writes
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = (torch.randn(len(lens), heads, 96, generator=torch.Generator().manual_seed(2))[..., :64] * 2).to(dtype)
    ref = paged_decode_attention(q, cache, tables, ctx, 0.125)
    out = triton_paged.paged_decode_attention(q, cache, tables, ctx, 0.125, partitions=partitions, block_n=block_n)
    assert rel(out, ref) < 4e-3
    if partitions is None:  # and the dispatch takes the kernel
        on_triton = dataclasses.replace(cache, kernels=KernelSettings(path="triton"))
        assert torch.equal(paged_decode_attention(q, on_triton, tables, ctx, 0.125), out)


@triton.jit
def round_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, triton_paged._round_half_even(tl.load(x_ptr + offs)))


def test_kernel_rounding_is_torch_round(triton_interpreter):
    """Ties go to the even integer, as torch.round (random inputs rarely land on a tie)."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 254.5, 3.2, -3.7, 7.0, 0.49999997, 12.5, 13.5, -0.0, 1e-3, 99.5])
    out = torch.empty_like(x)
    round_kernel[(1,)](x, out, BLOCK=16)
    assert torch.equal(out, torch.round(x))


def test_prefill_reads_the_lengths_on_the_host_once_given(monkeypatch):
    """Given the step's host lists (the runner passes them to every layer), the prefill reads nothing back
    from the device and computes what it computes from the tensors; without them each call reads the
    tensors, so an in-place change is seen."""
    lens = [20, 33]
    cache, tables, _, _ = filled_cache(lens, 2, 64, 16, torch.float32, seed=9)
    q = torch.randn(2, 4, 64)
    ctx, start = torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    first = paged_prefill_attention(q, cache, tables, ctx, start, 0.1)
    assert len(reads) == 2
    assert torch.equal(paged_prefill_attention(q, cache, tables, ctx, start, 0.1, ([0, 1, 2], lens)), first)
    assert len(reads) == 2
    ctx[1] = 17  # the runner reusing a buffer: a call without host lists reads it again
    shorter = paged_prefill_attention(q, cache, tables, ctx, start, 0.1)
    assert len(reads) == 4 and torch.equal(shorter[0], first[0]) and not torch.allclose(shorter[1], first[1])


# ---- static per-head scales (calibration statistics)

def static_ranges(kv_heads, head_dim, seed):
    """Calibrated-looking ranges [kv_heads, head_dim]: per channel, negative minima and positive maxima."""
    g = torch.Generator().manual_seed(seed)
    lo = -(torch.rand(kv_heads, head_dim, generator=g) * 2 + 0.5)
    hi = torch.rand(kv_heads, head_dim, generator=g) * 3 + 0.5
    return lo, hi


def test_static_scales_span_each_heads_range():
    """One scale and zero per head, from the range over its channels: just above range / qmax, and the
    codes span the range to half a step at either end (the zero is rounded)."""
    for bits in (8, 4):
        (klo, khi), (vlo, vhi) = static_ranges(3, 16, 1), static_ranges(3, 16, 2)
        ks, kz, vs, vz = static_scales(klo, khi, vlo, vhi, bits)
        assert ks.dtype == torch.float16 and kz.dtype == torch.uint8 and ks.shape == (3,)
        for (lo, hi), s, z in (((klo, khi), ks, kz), ((vlo, vhi), vs, vz)):
            exact = (hi.amax(-1).double() - lo.amin(-1).double()) / QMAX[bits]
            assert ((s.double() >= exact) & (s.double() <= exact * (1 + 2 ** -8))).all()
            assert (s.float() * (QMAX[bits] - z.float() + 0.5) >= hi.amax(-1)).all()
            assert (-s.float() * (z.float() + 0.5) <= lo.amin(-1)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_static_write_uses_the_heads_scales(bits):
    kv_heads, d = 2, 64
    (klo, khi), (vlo, vhi) = static_ranges(kv_heads, d, 3), static_ranges(kv_heads, d, 4)
    static = static_scales(klo, khi, vlo, vhi, bits)
    cache = PagedKV.allocate(3, BLOCK, kv_heads, d, bits, torch.float32, "cpu", static=static)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(20, kv_heads, d, generator=g)
    v = torch.randn(20, kv_heads, d, generator=g) * 0.5
    k[2, 0, 5] = 100.0  # far outside the calibrated range: clipped to the top code, not a new scale
    slots = torch.randperm(3 * BLOCK, generator=g)[:20]
    write_kv(cache, k, v, slots)
    for x, codes, scale, zero, s, z in ((k, *cache.by_slot("k"), *static[:2]),
                                        (v, *cache.by_slot("v"), *static[2:])):
        assert torch.equal(scale.reshape(-1, kv_heads)[slots], s.expand(20, kv_heads))
        assert torch.equal(zero.reshape(-1, kv_heads)[slots], z.expand(20, kv_heads))
        want = (torch.round(x / s.float()[:, None]) + z.float()[:, None]).clamp(0, QMAX[bits])
        assert torch.equal(codes.reshape(-1, kv_heads, codes.shape[-1])[slots], pack(want.to(torch.uint8), bits))
    # Reading back: within half a step where the value lies in the head's range; the outlier clipped.
    k_back, _ = gather_kv(cache, torch.arange(3, dtype=torch.int32), 3 * BLOCK, torch.float32)
    k_back = k_back[slots]
    top = (QMAX[bits] - static[1].float()) * static[0].float()
    assert k_back[2, 0, 5] == top[0]
    inside = (k >= (-static[1].float() * static[0].float())[:, None]) & (k <= top[:, None])
    err = (k_back - k).abs()[inside]
    assert inside.float().mean() > 0.8 and (err <= static[0].float().max() * 0.501).all()


def test_static_scales_are_checked():
    static = static_scales(*static_ranges(2, 64, 1), *static_ranges(2, 64, 2), 8)
    with pytest.raises(UserError, match="one per KV head"):
        PagedKV.allocate(1, BLOCK, 4, 64, 8, torch.float16, "cpu", static=static)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_static_write_equals_reference(monkeypatch, triton_interpreter, bits, dtype):
    """The kernel's STATIC path: same codes, and the per-head scales and zeros in every written slot."""
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(19, 5, 64, generator=g) * 1.5).to(dtype)
    k, v = qkv[:, 2:4], qkv[:, 4:5].expand(19, 2, 64)  # views; v's heads share one row (stride 0)
    slots = torch.randperm(4 * BLOCK, generator=g)[:19]
    slots[6] = -1
    static = static_scales(*static_ranges(2, 64, 7), *static_ranges(2, 64, 8), bits)
    caches = []
    for path in ("reference", "triton"):
        cache = PagedKV.allocate(4, BLOCK, 2, 64, bits, dtype, "cpu", static=static, kernels=KernelSettings(path=path))
        write_kv(cache, k, v, slots)
        caches.append(cache)
    ref, tri = caches
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.equal(getattr(tri, name), getattr(ref, name)), name
    assert (ref.by_slot("k")[1].reshape(-1, 2)[slots[slots >= 0]] == static[0]).all()
    online = PagedKV.allocate(4, BLOCK, 2, 64, bits, dtype, "cpu")
    write_kv(online, k, v, slots)  # the static codes are not the online ones
    assert not torch.equal(online.k, tri.k)
