"""End to end on the GPU: checkpoints quantkit wrote, loaded with quantkit.load on CUDA; the logits of
the kernels (the default on CUDA) against those of the torch reference path (KernelSettings(path="reference"))
for 1, 16 and 100 rows of activations (the GEMV, and on Hopper the Gluon GEMM for the 100)."""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit_testing.gpu_checks import rel_err
from quantkit.kernels.settings import KernelSettings
from quantkit.nn import QuantLinear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
# (batch, tokens): 1, 16 and 100 rows of x per linear
INPUTS = ((1, 1), (2, 8), (2, 50))
# bench/kernels_e2e.py measured 1.2e-3 to 1.8e-3 on a 2-layer 7B-shape model.
TOL = 1e-2


@pytest.mark.parametrize("scheme", ["w4g128", "w8"])
def test_kernel_logits_match_reference_path(small_llama, scheme, monkeypatch):
    model, _ = quantkit.load(small_llama[scheme], device=DEVICE)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 7
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 300, shape, generator=g).to(DEVICE) for shape in INPUTS]
    for layer in layers:
        layer.kernels = KernelSettings(path="reference")
    with torch.no_grad():
        want = [model(x).logits.float() for x in ids]
    assert not any("_kernel_weights" in m.__dict__ for m in layers)  # the kernels had not run yet
    for layer in layers:
        layer.kernels = KernelSettings()  # the default: the kernels on CUDA
    with torch.no_grad():
        got = [model(x).logits.float() for x in ids]
    assert all("_kernel_weights" in m.__dict__ for m in layers)  # every linear went through the kernels
    for shape, a, b in zip(INPUTS, got, want):
        assert b.abs().max() > 0 and b.std() > 0.05  # the model computes something a bug could change
        err = rel_err(a, b)
        assert err <= TOL, (shape, err)
