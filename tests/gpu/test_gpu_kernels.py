"""QuantLinear on the GPU at Llama-2-7B layer shapes against the torch reference, eager and graphed.

Random packed integers, zeros and scales, random activations (never zeros). Each case calls the layer
twice with different inputs (eagerly the second call takes the layer's kept launch, not Triton's
front end), or captures it in a CUDA graph and replays it twice on new inputs into an output
buffer poisoned with NaN (on Hopper the Gluon GEMM runs only there). The reference is the layer's own
dequantized weight (quantkit.kernels.reference) in a float32 matrix product.
"""

from __future__ import annotations

import pytest
import torch

from quantkit_testing.gpu_checks import capture, rel_err
from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.nn import QuantLinear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (K, N) of Llama-2-7B's linears: o, gate (or up), q+k+v fused (with a bias, as Qwen's), down,
# gate+up fused. They span the dispatch's width classes (narrow, mid, wide) and its long-K case.
SHAPES = {"o": (4096, 4096), "gate": (4096, 11008), "qkv": (4096, 12288), "down": (11008, 4096),
          "gate_up": (4096, 22016)}
# (bits, group size, checkpoint layout, symmetric)
SCHEMES = {"w4g128": (4, 128, "awq", False), "w8-channel": (8, -1, "packed", True),
           "w8g128": (8, 128, "packed", False)}
MS = (1, 8, 16, 64, 128, 256, 512)
# bench/kernels_check.py's bound; the H200 runs there measured at most 3e-3.
TOL = 1e-2

_layers: dict[tuple[str, str], tuple[QuantLinear, torch.Tensor]] = {}


def layer_and_weight(shape: str, scheme: str) -> tuple[QuantLinear, torch.Tensor]:
    """(the layer on the GPU, its reference weight W [N, K] float32), made once per module."""
    key = (shape, scheme)
    if key not in _layers:
        k, n = SHAPES[shape]
        bits, gs, layout, symmetric = SCHEMES[scheme]
        groups = 1 if gs == -1 else k // gs
        g = torch.Generator(device="cuda").manual_seed(len(_layers))
        q = torch.randint(0, 2**bits, (n, k), generator=g, device="cuda", dtype=torch.int32)
        if symmetric:
            z = torch.full((n, groups), 2 ** (bits - 1), device="cuda", dtype=torch.int32)
        else:
            z = torch.randint(0, 2**bits, (n, groups), generator=g, device="cuda", dtype=torch.int32)
        s = (torch.rand(n, groups, generator=g, device="cuda") * 0.02 + 0.002).half()
        tensors = pack_awq_gemm(q, z, s) if layout == "awq" else pack_compressed(q, z, s, bits, symmetric)
        bias = shape == "qkv"
        if bias:
            tensors["bias"] = (torch.randn(n, generator=g, device="cuda") * 0.5).half()
        layer = QuantLinear(k, n, bits, gs, layout=layout, symmetric=symmetric, bias=bias, device="cuda")
        layer.load_state_dict(tensors)
        layer.cuda()
        weight = layer.dequantized_weight()  # before the first Triton call moves the packed tensors to the host
        _layers[key] = layer, weight
    return _layers[key]


def reference(x: torch.Tensor, layer: QuantLinear, weight: torch.Tensor) -> torch.Tensor:
    y = x.float() @ weight.t()
    return y if layer.bias is None else y + layer.bias.float()


def inputs(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, k, generator=g, device="cuda") * 0.5).half()


def kernel_used(layer: QuantLinear, m: int, graphed: bool) -> str:
    """The dispatch's choice for this call, for the failure message."""
    from quantkit.kernels import dispatch

    kw = layer.__dict__.get("_kernel_weights")
    if kw is None:
        return "no kernel layout (the reference path ran)"
    return f"{type(kw).__name__}: {dispatch.choice_for(kw, m, torch.device('cuda'), graphed=graphed)}"


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_eager_calls_match_reference(shape, scheme, m):
    layer, weight = layer_and_weight(shape, scheme)
    k = SHAPES[shape][0]
    for seed in (1, 2):  # the first call makes the layer's launch for this M, the second reuses it
        x = inputs(m, k, seed)
        with torch.no_grad():
            y = layer(x)
        assert y.shape == (m, layer.out_features) and y.dtype == torch.float16
        err = rel_err(y, reference(x, layer, weight))
        assert err <= TOL, (err, kernel_used(layer, m, graphed=False), seed)
    from quantkit.kernels.triton_mma import MmaWeights

    # Whole 128-input groups (or one per row) with fp16 activations take the tensor-core layout.
    assert isinstance(layer.__dict__.get("_kernel_weights"), MmaWeights)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_graph_replays_match_reference(shape, scheme, m):
    layer, weight = layer_and_weight(shape, scheme)
    k = SHAPES[shape][0]
    x = inputs(m, k, 3)
    with torch.no_grad():
        graph, y = capture(lambda: layer(x))
    for seed in (4, 5):  # new inputs in the captured buffer; the output poisoned before each replay
        x.copy_(inputs(m, k, seed))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(y, reference(x, layer, weight))
        assert err <= TOL, (err, kernel_used(layer, m, graphed=True), seed)
