"""kernels/fused.py: the torch reference against float64 math and transformers' Llama modules; the Triton
kernels (kernels/triton_fused.py) against the reference under TRITON_INTERPRET=1 (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import fused
from quantkit.kernels.settings import KernelSettings


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def cos_sin_table(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float(), angles


# ---- reference

def test_rms_norm_matches_float64():
    x, r, w = rand(5, 96), rand(5, 96, seed=1), rand(96, seed=2)
    h64 = x.double() + r.double()
    want = h64 / (h64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    out, h = fused.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h.double(), h64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    alone = fused.rms_norm(x, w, 1e-6)
    x64 = x.double()
    torch.testing.assert_close(alone.double(), x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_rounds_as_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(128, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(128, seed=3) * 0.5 + 1)
    x, r = rand(7, 128, dtype=dtype), rand(7, 128, seed=4, dtype=dtype)
    out, h = fused.rms_norm(x, norm.weight, 1e-5, residual=r)
    assert torch.equal(h, x + r)
    assert torch.equal(out, norm(x + r))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_matches_transformers_rotate_half(rotary_dim):
    """Neox halves on the first rotary_dim of 64 channels (partial rotary leaves the rest untouched)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = rand(6, 4, 64), rand(6, 2, 64, seed=1)
    positions = torch.tensor([0, 3, 9, 1, 17, 30])
    cos_sin, angles = cos_sin_table(32, rotary_dim)
    emb = torch.cat((angles, angles), dim=-1)[positions]
    q_ref, k_ref = q.clone(), k.clone()
    # cos, sin [T, rotary_dim] unsqueezed at dim 1 broadcast over the heads of q, k [T, heads, rotary_dim]
    rq, rk = apply_rotary_pos_emb(q[..., :rotary_dim].double(), k[..., :rotary_dim].double(), emb.cos(), emb.sin())
    q_ref[..., :rotary_dim], k_ref[..., :rotary_dim] = rq.float(), rk.float()
    fused.apply_rope_(q, k, positions, cos_sin, rotary_dim)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


def test_rope_interleaved_rotates_adjacent_pairs():
    q, k = rand(3, 2, 8), rand(3, 1, 8, seed=1)
    positions = torch.tensor([5, 0, 2])
    cos_sin, angles = cos_sin_table(8, 8)
    want_q = q.double().clone()
    a = angles[positions][:, None, :]  # [T, 1, 4]
    x1, x2 = q.double()[..., 0::2], q.double()[..., 1::2]
    want_q[..., 0::2], want_q[..., 1::2] = x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()
    fused.apply_rope_(q, k, positions, cos_sin, 8, interleaved=True)
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_float64():
    x = rand(4, 3, 2 * 48) * 3
    g, u = x.double()[..., :48], x.double()[..., 48:]
    torch.testing.assert_close(fused.silu_mul(x).double(), g / (1 + (-g).exp()) * u, rtol=1e-5, atol=1e-5)


# ---- Triton against the reference

def both_paths(fn):
    """fn(kernels) on the reference, then on the Triton kernels (interpreted)."""
    return fn(KernelSettings(path="reference")), fn(KernelSettings(path="triton"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_rms_norm(triton_interpreter, dtype, residual):
    x, r, w = rand(5, 3, 96, dtype=dtype), rand(5, 3, 96, seed=1, dtype=dtype), rand(96, seed=2, dtype=dtype)
    ref, out = both_paths(lambda kernels: fused.rms_norm(x, w, 1e-6, r if residual else None, kernels))
    if residual:
        assert torch.equal(out[1], ref[1])
        ref, out = ref[0], out[0]
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert (out != ref).float().mean() < 0.05  # a few last-bit differences (rsqrt order), no more


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_triton_rope(triton_interpreter, interleaved, rotary_dim):
    qkv = rand(7, 8 * 64, dtype=torch.float16)  # q (4 heads), k (2), v (2) as views of one fused output
    positions = torch.tensor([0, 3, 9, 1, 17, 30, 31])
    cos_sin, _ = cos_sin_table(32, rotary_dim)

    def run(kernels):
        t = qkv.clone()
        q, k = t[:, :256].view(7, 4, 64), t[:, 256:384].view(7, 2, 64)
        fused.apply_rope_(q, k, positions, cos_sin, rotary_dim, interleaved, kernels)
        return t

    ref, out = both_paths(run)
    assert not torch.equal(ref, qkv)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(out[:, 384:], qkv[:, 384:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_silu_mul(triton_interpreter, dtype):
    x = rand(6, 2 * 1100, dtype=dtype) * 3  # an intermediate size that is no multiple of the tile
    ref, out = both_paths(lambda kernels: fused.silu_mul(x, kernels))
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert (out != ref).float().mean() < 0.05
