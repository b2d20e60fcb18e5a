"""The engine's Triton kernels (kernels/triton_paged.py, triton_fused.py) on the GPU at real shapes, against the
torch reference (kernels/paged_kv.py with KernelSettings(path="reference")) run on the same GPU.

Llama-2-7B (32 heads of 128, MHA) and Llama-3-8B (32 query heads over 8 KV heads) decode attention at
batch 1 and 32, contexts up to 100, 4096 and 8192 tokens, fp16/int8/int4 blocks, and packed prefill steps; random K/V/Q (never
zeros) written by the Triton write kernel into blocks handed out in a random order. The write itself
must give the reference's codes, scales and zeros byte for byte; the decode is also captured in a
CUDA graph and replayed with other context lengths (its grid must not depend on them). Then the fused
RMSNorm (+ residual), RoPE and SiLU·mul kernels (kernels/triton_fused.py) against their reference.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from quantkit_testing.gpu_checks import capture, rel_err
from quantkit.kernels.paged_kv import PagedKV, paged_decode_attention, paged_prefill_attention, write_kv
from quantkit.kernels.settings import KernelSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK = 16
SHAPES = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # heads, kv heads, head_dim
# fp16 probabilities in p·v cost about 1e-3; int codes are dequantized exactly as the reference does
TOL = 5e-3


def context_lens(batch: int, longest: int, g: torch.Generator) -> torch.Tensor:
    """The longest context once, the others drawn from [longest / 2, longest] (partial blocks)."""
    lens = torch.randint(max(1, longest // 2), longest + 1, (batch,), generator=g)
    lens[0] = longest
    return lens.int()


def filled_cache(lens: torch.Tensor, kv_heads: int, head_dim: int, bits: int, seed: int):
    """(cache, block tables [B, max_blocks] int32 on the GPU) with every context's K/V written."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(int(n) / BLOCK) for n in lens]
    width = max(need) + 3
    num_blocks = sum(need) + 8
    cache = PagedKV.allocate(num_blocks, BLOCK, kv_heads, head_dim, bits, torch.float16, "cuda")
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(need), width), generator=g, dtype=torch.int32)  # garbage past
    slots, used = [], 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n].int()
        used += n
        pos = torch.arange(int(lens[b]))
        slots.append(tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    slots = torch.cat(slots).cuda()
    gc = torch.Generator(device="cuda").manual_seed(seed)
    for start in range(0, slots.numel(), 1 << 16):  # K/V made and written in chunks: 8192 × 32 tokens at once is 4 GB
        s = slots[start:start + (1 << 16)]
        k = torch.randn(s.numel(), kv_heads, head_dim, generator=gc, device="cuda").half()
        v = torch.randn(s.numel(), kv_heads, head_dim, generator=gc, device="cuda").half()
        write_kv(cache, k, v, s)
    return cache, tables.cuda()


REFERENCE = KernelSettings(path="reference")


def reference_decode(q, cache, *args) -> torch.Tensor:
    return paged_decode_attention(q, dataclasses.replace(cache, kernels=REFERENCE), *args)


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_write_equals_reference(monkeypatch, shape, bits):
    _, kv_heads, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(bits)
    qkv = torch.randn(3000, 3 * kv_heads, d, generator=g, device="cuda")
    qkv = (qkv * torch.rand(3000, 3 * kv_heads, 1, generator=g, device="cuda") * 4).half()
    k, v = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]  # views of one fused output
    slots = torch.randperm(200 * BLOCK, generator=g, device="cuda")[:3000]
    slots[::97] = -1
    caches = []
    for path in ("reference", "triton"):
        caches.append(PagedKV.allocate(200, BLOCK, kv_heads, d, bits, torch.float16, "cuda",
                                       kernels=KernelSettings(path=path)))
        write_kv(caches[-1], k, v, slots)
    torch.cuda.synchronize()
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        ref, out = getattr(caches[0], name), getattr(caches[1], name)
        if ref is not None:
            diff = (out.int() - ref.int()).abs() if not out.is_floating_point() else (out.float() - ref.float()).abs()
            assert torch.equal(out, ref), (name, int((diff > 0).sum()), float(diff.max()))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_static_write_equals_reference(monkeypatch, shape, bits):
    """The write with static per-head scales (paged_kv.static_scales from calibrated ranges): the same
    codes as the reference, and every written slot holds its head's scale and zero."""
    from quantkit.kernels.paged_kv import static_scales

    _, kv_heads, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(10 + bits)
    k = (torch.randn(3000, kv_heads, d, generator=g, device="cuda") * 2).half()
    v = torch.randn(3000, kv_heads, d, generator=g, device="cuda").half()
    ranges = [torch.rand(kv_heads, d, generator=g, device="cuda") * 3 + 0.5 for _ in range(4)]
    static = static_scales(-ranges[0], ranges[1], -ranges[2], ranges[3], bits)
    slots = torch.randperm(200 * BLOCK, generator=g, device="cuda")[:3000]
    slots[::97] = -1
    caches = []
    for path in ("reference", "triton"):
        caches.append(PagedKV.allocate(200, BLOCK, kv_heads, d, bits, torch.float16, "cuda", static=static,
                                       kernels=KernelSettings(path=path)))
        write_kv(caches[-1], k, v, slots)
    torch.cuda.synchronize()
    for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
        ref, out = getattr(caches[0], name), getattr(caches[1], name)
        diff = (out.int() - ref.int()).abs() if not out.is_floating_point() else (out.float() - ref.float()).abs()
        assert torch.equal(out, ref), (name, int((diff > 0).sum()), float(diff.max()))
    written = slots[slots >= 0]
    assert (caches[1].by_slot("k")[1].reshape(-1, kv_heads)[written] == static[0]).all()


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("batch,longest", [(1, 100), (1, 4096), (1, 8192), (32, 100), (32, 4096), (32, 8192)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_attention(monkeypatch, shape, batch, longest, bits):
    heads, kv_heads, d = SHAPES[shape]
    g = torch.Generator().manual_seed(batch + longest)
    lens = context_lens(batch, longest, g)
    cache, tables = filled_cache(lens, kv_heads, d, bits, seed=bits)
    q = (torch.randn(batch, heads, d, generator=g) * 3).half().cuda()
    ctx = lens.cuda()
    scale = d**-0.5
    out = paged_decode_attention(q, cache, tables, ctx, scale)
    ref = reference_decode(q, cache, tables, ctx, scale)
    err = rel_err(out, ref)
    assert err < TOL, f"{shape} batch {batch} context ≤ {longest} kv{bits}: relative error {err:.2e}"


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_decode_attention_in_a_cuda_graph(monkeypatch, bits):
    """Captured once with long contexts, replayed with shorter and longer ones: the same as eager."""
    heads, kv_heads, d = SHAPES["llama3-8b"]
    g = torch.Generator().manual_seed(5)
    cache, tables = filled_cache(torch.full((8,), 3000, dtype=torch.int32), kv_heads, d, bits, seed=bits)
    q = (torch.randn(8, heads, d, generator=g) * 3).half().cuda()
    ctx = torch.full((8,), 2000, dtype=torch.int32, device="cuda")
    graph, out = capture(lambda: paged_decode_attention(q, cache, tables, ctx, d**-0.5))
    for lens in ([3000, 1, 17, 2999, 1024, 16, 100, 2500], [5, 3000, 33, 64, 65, 1000, 2048, 7]):
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_((torch.randn(8, heads, d, generator=g) * 3).half())
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(q, cache, tables, ctx, d**-0.5)
        assert rel_err(out, ref) < TOL, lens


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rows_decode_kernel_equals_dot(monkeypatch, shape, bits):
    """The decode kernel without tl.dot (triton_paged_rows) against decode_kernel and the reference, at
    batch 32 with contexts up to 4,096 (one of them empty), eagerly and replayed in a CUDA graph."""
    from quantkit.kernels import triton_paged  # here: collecting tests/gpu must not import Triton

    heads, kv_heads, d = SHAPES[shape]
    g = torch.Generator().manual_seed(bits + heads // kv_heads)
    lens = context_lens(32, 4096, g)
    cache, tables = filled_cache(lens, kv_heads, d, bits, seed=bits)
    lens[5] = 0
    q = (torch.randn(32, heads, d, generator=g) * 3).half().cuda()
    ctx = lens.cuda()
    dot = triton_paged.paged_decode_attention(q, cache, tables, ctx, d**-0.5, kernel="dot")
    graph, rows = capture(lambda: triton_paged.paged_decode_attention(q, cache, tables, ctx, d**-0.5, kernel="rows"))
    graph.replay()
    torch.cuda.synchronize()
    assert (rows[5] == 0).all() and (dot[5] == 0).all()
    live = lens != 0
    ref = reference_decode(q[live], cache, tables[live.cuda()], ctx[live.cuda()], d**-0.5)
    assert rel_err(rows[live.cuda()], ref) < TOL and rel_err(rows, dot) < TOL
    ctx.copy_(torch.flip(lens, (0,)).cuda())  # other lengths, the same graph
    graph.replay()
    want = triton_paged.paged_decode_attention(q, cache, tables, ctx, d**-0.5, kernel="dot")
    assert rel_err(rows, want) < TOL


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_attention(monkeypatch, shape, bits):
    """One packed prefill step (kernels/triton_prefill.py): whole prompts, chunks after a cached prefix, a
    one-token row and a sequence with no new token, against gather + SDPA per sequence."""
    heads, kv_heads, d = SHAPES[shape]
    g = torch.Generator().manual_seed(20 + bits)
    lens = torch.tensor([512, 1000, 37, 2048, 300, 4100], dtype=torch.int32)
    new = torch.tensor([512, 200, 37, 1, 0, 1500])
    cache, tables = filled_cache(lens, kv_heads, d, bits, seed=bits)
    starts = torch.zeros(len(lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(new, 0)
    q = (torch.randn(int(starts[-1]), heads, d, generator=g) * 3).half().cuda()
    args = (q, cache, tables, lens.cuda(), starts.cuda(), d**-0.5)
    out = paged_prefill_attention(*args)
    ref = paged_prefill_attention(q, dataclasses.replace(cache, kernels=REFERENCE), *args[2:])
    for b in range(len(lens)):
        s, e = int(starts[b]), int(starts[b + 1])
        if e > s:
            err = rel_err(out[s:e], ref[s:e])
            assert err < TOL, f"{shape} kv{bits} sequence {b} ({e - s} of {int(lens[b])} tokens): {err:.2e}"


# ---- the fused elementwise ops (kernels/fused.py) at Llama shapes

def both_paths(fn):
    """fn(kernels) on the torch reference, then on the Triton kernel (the default on CUDA)."""
    return fn(REFERENCE), fn(KernelSettings())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 33, 2048])
def test_rms_norm(monkeypatch, tokens, dtype):
    from quantkit.kernels.fused import rms_norm

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x, r = (torch.randn(tokens, 4096, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = (torch.rand(4096, generator=g, device="cuda") + 0.5).to(dtype)
    (ref, ref_h), (out, h) = both_paths(lambda kernels: rms_norm(x, w, 1e-5, r, kernels))
    assert torch.equal(h, ref_h)
    assert rel_err(out, ref) < 1e-2 and (out != ref).float().mean() < 0.05
    ref, out = both_paths(lambda kernels: rms_norm(x, w, 1e-5, kernels=kernels))
    assert rel_err(out, ref) < 1e-2 and (out != ref).float().mean() < 0.05


@pytest.mark.parametrize("interleaved,rotary_dim", [(False, 128), (True, 64)])
@pytest.mark.parametrize("tokens", [1, 2048])
def test_rope(monkeypatch, tokens, interleaved, rotary_dim):
    from quantkit.kernels.fused import apply_rope_

    g = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, 48 * 128, generator=g, device="cuda").half()  # Llama-3-8B: 32 q, 8 k, 8 v heads
    positions = torch.randint(0, 8192, (tokens,), generator=g, device="cuda")
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim)
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv_freq
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)

    def run(kernels):
        t = qkv.clone()
        apply_rope_(t[:, :4096].view(tokens, 32, 128), t[:, 4096:5120].view(tokens, 8, 128), positions, cos_sin,
                    rotary_dim, interleaved, kernels)
        return t

    ref, out = both_paths(run)
    assert not torch.equal(ref, qkv) and torch.equal(out[:, 5120:], qkv[:, 5120:])
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)  # a last-bit difference at most (FMA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul(monkeypatch, dtype):
    from quantkit.kernels.fused import silu_mul

    x = (torch.randn(77, 2 * 11008, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda") * 3)
    x = x.to(dtype)
    ref, out = both_paths(lambda kernels: silu_mul(x, kernels))
    assert rel_err(out, ref) < 1e-2 and (out != ref).float().mean() < 0.05
