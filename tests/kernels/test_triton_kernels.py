"""Triton kernels against the torch reference, on the CPU under TRITON_INTERPRET=1 (see conftest.py).

Random weights and activations (never zeros), outputs poisoned with NaN before each run, odd M and N
that are no multiple of the tiles, fp16 and bf16, W4 with group sizes 32/64/128 in both layouts and
W8 per channel; ‖out − ref‖ / ‖ref‖ ≤ 1e-2 against x Wᵀ + b in float32, W dequantized by
quantkit.kernels.reference (itself checked against float64 in test_reference.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.kernels import triton_layout
from quantkit.kernels.settings import KernelSettings
from quantkit_testing.kernel_oracles import packed_layer

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = 1e-2
CASES = [  # bits, group size, format, symmetric, K, N
    (4, 32, "awq", False, 128, 40),
    (4, 64, "packed", True, 128, 37),
    (4, 128, "awq", False, 256, 24),
    (8, -1, "packed", True, 96, 33),
    (8, -1, "packed", False, 80, 19),
]


def make_weights(bits, gs, fmt, symmetric, k, n, seed=0):
    """(KernelWeights, reference linear (x, b) ↦ x Wᵀ + b in float32) for random integers, zeros and scales."""
    g = torch.Generator().manual_seed(seed)
    gsz = k if gs == -1 else gs
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(1, 2**bits - 1, (n, k // gsz), generator=g, dtype=torch.int32)
    s = (torch.rand(n, k // gsz, generator=g) * 0.02 + 0.002).half()
    kw, w = packed_layer(q, z, s, bits, gsz, fmt, symmetric)
    return kw, lambda x, b=None: F.linear(x.float(), w, None if b is None else b.float())


def rel(out, ref):
    assert torch.isfinite(out).all(), "output holds NaN/Inf: some element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_kernels_run_in_the_interpreter():
    from quantkit.kernels.triton_gemm import gemm_kernel
    from quantkit.kernels.triton_gemv import gemv_kernel

    assert type(gemv_kernel).__name__ == "InterpretedFunction"
    assert type(gemm_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("bits", [4, 8])
def test_block_planar_round_trip(bits):
    q = torch.randint(0, 2**bits, (5, 72), dtype=torch.int32)  # 72 is no multiple of the 32-input block
    packed = triton_layout.pack_block_planar(q, bits)
    assert packed.shape == (5, -(-72 * bits // 32 // 4) * 4)
    assert torch.equal(triton_layout.unpack_block_planar(packed, bits, 72), q)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c[0]}g{c[1]}-{c[2]}-{'sym' if c[3] else 'asym'}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernels_match_reference(case, dtype):
    from quantkit.kernels.triton_gemm import dequantize, gemm
    from quantkit.kernels.triton_gemv import gemv

    kw, ref_fn = make_weights(*case, seed=case[1] + case[0])
    k, n = case[4], case[5]
    bias = (torch.randn(n) * 0.1).to(dtype)
    runs = {
        "gemv split-K": (3, lambda x, y: gemv(x, kw, bias, block_n=16, blocks=2, split_k=2, out=y)),
        "gemm swap split-K": (17, lambda x, y: gemm(x, kw, bias, block_m=16, block_n=16, blocks=4, split_k=3,
                                                    swap_ab=True, out=y)),
        "gemm": (5, lambda x, y: gemm(x, kw, bias, block_m=16, block_n=32, blocks=4, out=y)),
        "gemv pipelined": (2, lambda x, y: gemv(x, kw, bias, block_n=16, blocks=2, num_stages=2, out=y)),
    }
    for name, (m, fn) in runs.items():
        x = (torch.randn(m, k) * 0.5).to(dtype)
        y = torch.full((m, n), float("nan"), dtype=dtype)
        fn(x, y)
        err = rel(y, ref_fn(x, bias))
        assert err <= TOL, f"{name}: relative error {err:.2e}"
    w = dequantize(kw, dtype, block_n=16, blocks=2)
    x = (torch.randn(2, k) * 0.5).to(dtype)
    assert rel(x.float() @ w.float().t(), ref_fn(x).float()) <= TOL


def test_split_k_leaves_counters_zeroed():
    from quantkit.kernels.triton_gemv import gemv
    from quantkit.kernels.triton_splitk import counters

    kw, ref_fn = make_weights(4, 32, "awq", False, 256, 40)
    x = torch.randn(2, 256).half()
    for _ in range(2):  # a second launch relies on the first having reset its counters
        y = gemv(x, kw, block_n=16, blocks=2, split_k=4)
        assert rel(y, ref_fn(x)) <= TOL
    assert int(counters(x.device, 1).abs().sum()) == 0


def test_quant_linear_forward_on_triton_path(monkeypatch):
    from quantkit.kernels import dispatch
    from quantkit.nn import QuantLinear

    kw, _ = make_weights(4, 64, "awq", False, 128, 48)
    layer = QuantLinear(128, 48, 4, 64, layout="awq", bias=True)
    g = torch.Generator().manual_seed(3)
    t = pack_awq_gemm(torch.randint(0, 16, (48, 128), generator=g), torch.randint(0, 16, (48, 2), generator=g),
                      (torch.rand(48, 2, generator=g) * 0.02 + 0.002).half())
    layer.qweight.copy_(t["qweight"])
    layer.qzeros.copy_(t["qzeros"])
    layer.scales.copy_(t["scales"])
    layer.bias.copy_(torch.randn(48))
    x = torch.randn(3, 7, 128).half()  # M = 21 rows: the table's GEMM path
    layer.kernels = KernelSettings(path="reference")
    ref = layer(x)
    layer.kernels = KernelSettings(path="triton")
    out = layer(x)
    assert out.shape == (3, 7, 48) and rel(out, ref) <= TOL
    assert rel(layer(x[:1, :1]), ref[:1, :1]) <= TOL  # M = 1: the GEMV path
    assert dispatch.kernel_weights(layer) is layer._kernel_weights  # repacked once, then reused


def test_checkpoint_tensors_offloaded_once_repacked(monkeypatch):
    """On CUDA the dispatch keeps only the kernel layout on the device; here the same steps on the CPU."""
    from quantkit.kernels import dispatch
    from quantkit.nn import QuantLinear

    layer = QuantLinear(128, 40, 4, 32, layout="packed")
    g = torch.Generator().manual_seed(5)
    t = pack_compressed(torch.randint(0, 16, (40, 128), generator=g), torch.randint(0, 16, (40, 4), generator=g),
                        (torch.rand(40, 4, generator=g) * 0.02 + 0.002).half(), 4, False)
    for name, value in t.items():
        if name in layer._buffers:
            layer._buffers[name].copy_(value)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    calls, offload = [], QuantLinear.offload_checkpoint_tensors
    monkeypatch.setattr(QuantLinear, "offload_checkpoint_tensors", lambda self: calls.append(self) or offload(self))
    x = torch.randn(2, 128).half()
    layer.kernels = KernelSettings(path="reference")
    ref = layer(x)
    kw = dispatch.kernel_weights(layer, torch.device("cpu"), offload=True)
    assert calls == [layer]
    assert dispatch.kernel_weights(layer, torch.device("cpu"), offload=True) is kw and calls == [layer]  # once
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    layer.kernels = KernelSettings(path="triton")
    assert rel(layer(x), ref) <= TOL
    layer.kernels = KernelSettings(path="reference")
    assert torch.equal(layer(x), ref)  # the reference path still reads the (offloaded) checkpoint tensors
