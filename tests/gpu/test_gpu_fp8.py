"""FP8 W8A8 on the GPU's FP8 tensor cores (compute capability ≥ 8.9): the quantize kernels bit for bit the
torch reference's, every product the dispatch table can pick against the emulation, and the engine's
greedy tokens on an FP8 export against the emulated layers (quantkit.load on the reference path)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels import fp8, fused, reference
from quantkit.kernels.dispatch_table import TABLE
from quantkit.kernels.settings import KernelSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")]

REFERENCE = KernelSettings(path="reference")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# triton_fp8 is imported inside the tests: imported at collection, its kernels would be compiled-mode
# functions for the interpreter tests of tests/kernels collected after these (see tests/kernels/conftest.py).


@pytest.mark.parametrize("static", [False, True])
def test_quantize_kernels_are_the_reference_bit_for_bit(static):
    from quantkit.kernels import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", generator=g, dtype=torch.float16) * 3
    x[0] = 0
    s_in = torch.tensor([0.01], device="cuda") if static else None
    gate_up = torch.cat([x, x.flip(0)], 1)
    # The fused forms quantize the 16-bit SiLU·mul / RMSNorm output their Triton kernels compute, which may
    # differ from torch's by an ulp (the GPU's exp and rsqrt): bit for bit that output's quantization, and
    # within an ulp of the scale of torch's.
    for (q, s), (wq, ws), exact in (
            (triton_fp8.quantize(x, s_in), reference.quantize_fp8(x, s_in), None),
            (fused.silu_mul(gate_up, quantize=True, input_scale=s_in),
             reference.quantize_fp8(fused.silu_mul(gate_up), s_in),
             reference.quantize_fp8(fused.silu_mul(gate_up, REFERENCE), s_in)),
            (fused.rms_norm(x, x[1].abs(), 1e-5, quantize=True, input_scale=s_in),
             reference.quantize_fp8(fused.rms_norm(x, x[1].abs(), 1e-5), s_in),
             reference.quantize_fp8(fused.rms_norm(x, x[1].abs(), 1e-5, kernels=REFERENCE), s_in))):
        assert torch.equal(s, ws.expand_as(s))
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
        if exact is not None:
            assert torch.allclose(s, exact[1].expand_as(s), rtol=2e-3, atol=0)


@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008), (1000, 200)])
@pytest.mark.parametrize("m", [1, 9, 64, 300])
def test_every_product_the_table_names_is_the_emulation(n, k, m):
    from quantkit.kernels import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    ws = w.abs().amax(dim=1, keepdim=True) / 448
    wq = reference.encode_e4m3(w, ws)
    bias = torch.randn(n, device="cuda", generator=g, dtype=torch.float16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
    acts = fp8.quantize(x, None)
    want = torch.nn.functional.linear(acts.q.float() * acts.scale, reference.dequantize_fp8(wq, ws)) + bias.float()
    choices = {repr(c): c for rows in TABLE.values() for _, c in rows if c.method == "fp8-dot"}  # Choice: unhashable
    for choice in choices.values():
        got = triton_fp8.dot(acts.q, acts.scale, wq, ws, bias, torch.float16, **choice.params)
        assert rel(got, want) < 2e-3, choice
    if n % 16 == 0 and k % 16 == 0:
        assert rel(fp8.scaled_mm(acts.q, acts.scale, wq, ws, bias, torch.float16), want) < 2e-3
        per_tensor = ws.max().reshape(1)
        wq_t = reference.encode_e4m3(w, per_tensor)
        want_t = torch.nn.functional.linear(acts.q.float() * acts.scale, reference.dequantize_fp8(wq_t, per_tensor))
        assert rel(fp8.scaled_mm(acts.q, acts.scale, wq_t, per_tensor, None, torch.float16), want_t) < 2e-3
    got = fp8.linear(acts, wq, ws, bias, lambda: reference.dequantize_fp8(wq, ws))
    assert rel(got, want) < 2e-3


def test_engine_on_an_fp8_export_follows_the_emulation(small_llama):
    import quantkit
    from quantkit.engine import Engine, EngineConfig, SamplingParams

    path = small_llama["fp8"]
    engine = Engine(path, EngineConfig(cache_max_entry_count=0.05, max_num_seqs=8))
    assert engine.runner.graphs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 40, 17, 300)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params, progress=False)
    hf, _ = quantkit.load(path, device="cuda", kernels=REFERENCE)
    for p, out in zip(prompts, outputs):
        ids = torch.tensor([p + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        gap = (logits.max(1).values - chosen) / (logits.max(1).values - logits.min(1).values)
        assert float(gap.max()) <= 0.03, p[:4]
