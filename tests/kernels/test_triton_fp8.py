"""The FP8 kernels (kernels/triton_fp8.py, the quantizing RMSNorm) under TRITON_INTERPRET=1: quantization
bit for bit the torch reference's, the product against float64 math, and an Fp8Linear on the Triton path
against the same layer on the reference path."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import fp8, fused, reference
from quantkit.kernels.settings import KernelSettings
from quantkit.nn import Fp8Linear

TRITON, REFERENCE = KernelSettings(path="triton"), KernelSettings(path="reference")


def rand(*shape, seed=0, dtype=torch.float32, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:  # rows of different ranges, one all-zero row (the scale's floor), values at binade edges
        x = x * torch.rand(*shape[:-1], 1, generator=g) * 8
        rows = x.view(-1, shape[-1])
        rows[0] = 0
        rows[-1, :4] = torch.tensor([124.3, -125.6, 31.4, 448.0])
    return x.to(dtype)


def assert_same_fp8(got, want):
    q, s = got
    wq, ws = want
    assert q.dtype == torch.float8_e4m3fn and q.shape == wq.shape
    assert torch.equal(s, ws.expand_as(s)), (s, ws)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [96, 5000])  # one block per row; several (the kernel loops over K)
def test_quantize_is_the_reference_bit_for_bit(triton_interpreter, dtype, static, k):
    x = rand(4, k, dtype=dtype)
    input_scale = torch.tensor([0.0125]) if static else None
    got = fp8.quantize(x, input_scale, TRITON)
    assert_same_fp8(got[:2], reference.quantize_fp8(x, input_scale))
    assert got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_silu_mul_quantize_is_silu_mul_then_quantize(triton_interpreter, dtype, static):
    gate_up = rand(3, 2 * 2500, dtype=dtype)  # 2,500 features: the kernel's two passes loop over blocks
    input_scale = torch.tensor([0.02]) if static else None
    want = reference.quantize_fp8(fused.silu_mul(gate_up, REFERENCE), input_scale)
    assert_same_fp8(fused.silu_mul(gate_up, TRITON, True, input_scale), want)
    assert_same_fp8(fused.silu_mul(gate_up, REFERENCE, True, input_scale), want)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_quantize_is_rms_norm_then_quantize(triton_interpreter, residual, static):
    x, r, w = rand(5, 96, dtype=torch.float16), rand(5, 96, seed=1, dtype=torch.float16), rand(96, seed=2, spread=False)
    input_scale = torch.tensor([0.004]) if static else None
    res = r if residual else None
    plain = fused.rms_norm(x, w.half(), 1e-6, res, REFERENCE)
    out = plain[0] if residual else plain
    want = reference.quantize_fp8(out, input_scale)
    for kernels in (TRITON, REFERENCE):
        got = fused.rms_norm(x, w.half(), 1e-6, res, kernels, True, input_scale)
        if residual:
            got, h = got
            assert torch.equal(h, plain[1])
        assert_same_fp8(got, want)


def fp8_weight(n, k, per_tensor, seed=3):
    w = rand(n, k, seed=seed, spread=False)
    scale = w.abs().amax().reshape(1) / 448 if per_tensor else w.abs().amax(dim=1, keepdim=True) / 448
    return reference.encode_e4m3(w, scale), scale


@pytest.mark.parametrize("m", [1, 5, 17, 40])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_dot_is_the_scaled_product(triton_interpreter, m, per_tensor, static):
    from quantkit.kernels import triton_fp8

    n, k = 40, 160
    wq, ws = fp8_weight(n, k, per_tensor)
    x = rand(m, k, seed=m)
    q, s = reference.quantize_fp8(x, torch.tensor([0.02]) if static else None)
    bias = rand(n, seed=9, spread=False)
    want = (q.double() * s.double()) @ (wq.double() * ws.double().reshape(-1, 1)).t() + bias.double()
    for split_k, block_k in ((1, 32), (3, 32), (2, 64)):  # K = 160: 5 steps of 32, split unevenly; a ragged last step
        got = triton_fp8.dot(q, s, wq, ws, bias, torch.float32, block_n=16, block_m=16, block_k=block_k,
                             split_k=split_k)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_on_the_triton_path_equals_the_reference_path(triton_interpreter, activations, bias):
    n, k = 48, 96
    wq, ws = fp8_weight(n, k, False)
    layer = Fp8Linear(k, n, activations, bias=bias, dtype=torch.float16)
    layer.weight, layer.weight_scale = wq, ws
    if activations == "static":
        layer.input_scale = torch.tensor([0.01])
    if bias:
        layer.bias = rand(n, seed=4, spread=False).half()
    x = rand(2, 3, k, dtype=torch.float16)  # leading dims kept
    outs = {}
    for name, kernels in (("triton", TRITON), ("reference", REFERENCE)):
        layer.kernels = kernels
        outs[name] = layer(x)
        # activations handed over already quantized (a fused norm's) give the same result
        torch.testing.assert_close(layer(fp8.quantize(x, layer.input_scale, kernels)), outs[name], rtol=0, atol=0)
    assert outs["triton"].shape == (2, 3, n) and outs["triton"].dtype == torch.float16
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=2e-3, atol=2e-3)
