"""Learned rounding (quantize/learned.py) on tiny models: the parametrisation starts at the start codes,
the optimisation lowers each block's output error well below the error-feedback codes' where weights
have outliers, a seed fixes the result, the guard never keeps worse codes, and the export loads in the
engine and in transformers with the in-memory logits."""

from __future__ import annotations

import json

import pytest
import torch

import quantkit
from quantkit.config import ConfigError, WeightQuantConfig, build_config
from quantkit.engine.model import load_decoder
from quantkit.models.loading import load_fp_model
from quantkit.models.registry import spec_for_config
from quantkit.quantize import awq as awq_mod
from quantkit.quantize.learned import LearnedWeight
from quantkit.quantize.primitives import quantize_weight, quantize_with
from quantkit.quantize.rounding import gptq_codes
from quantkit_testing.decoder_check import assert_same_logits
from quantkit_testing.export_check import assert_export_is_the_in_memory_model
from quantkit_testing.tiny import make_tiny_model
from quantkit_testing.in_memory import awq_quantize

FAST = {"awq.n_grid": 8, "awq.search_tokens": 64, "calib.batch_size": 4, "weight.group_size": 32}


def windows(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def plant_outliers(model, seed: int = 0) -> None:
    """Loud input channels in every norm and a few large weights in every linear: the rounding and clip
    choices that a per-layer, per-weight criterion gets wrong."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(norm.weight.numel(), generator=g)[:3]] *= 8.0
            for lin in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
                flat = lin.weight.view(-1)
                flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 200]] *= 6.0


def run(model, method: str = "awq", bits: int = 4, **overrides):
    """Quantize `model` in place; returns the codes and the report's block entries."""
    report: dict = {}
    config = build_config(method=method, **{**FAST, **overrides})
    if bits != 4:  # no format stores 3 bits: the pass is in memory here, nothing is written
        object.__setattr__(config, "weight", WeightQuantConfig(bits, config.weight.group_size, config.weight.symmetric))
    q = awq_quantize(model, spec_for_config(model.config), config, windows(), report, progress=False)
    return q, report[method]["blocks"]


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, False), (4, False), (4, True), (8, False)])
def test_learned_weight_starts_at_the_start_codes(bits, symmetric):
    """V = 0 and r = 1 rebuild the start codes exactly: nearest ones, and error-feedback ones, anchored
    at W or at the weights GPTQ rounded (some of its codes lie a step or more from W's nearest)."""
    torch.manual_seed(bits)
    cfg = WeightQuantConfig(bits, 32, symmetric)
    w = torch.randn(24, 128) * (torch.rand(1, 128) * 3)
    nearest = quantize_weight(w, cfg)
    x = torch.randn(512, 8) @ torch.randn(8, 128) + 0.1 * torch.randn(512, 128)
    updated = torch.empty_like(w)
    codes = gptq_codes(w, x.t() @ x, nearest.scales, nearest.zeros, bits, 32, updated=updated).to(nearest.q.dtype)
    fed_back = type(nearest)(codes, nearest.zeros, nearest.scales, bits, 32)
    assert (codes != nearest.q).float().mean() > 0.05
    for start, rounded in ((nearest, w), (fed_back, w), (fed_back, updated)):
        lw = LearnedWeight(rounded, start)
        got = lw.export()
        assert torch.equal(got.q, start.q) and torch.equal(got.zeros, start.zeros)
        assert torch.equal(got.scales, start.scales)
        assert torch.equal(lw.dequantized().detach(), start.dequantize())
    # The weights GPTQ rounded: their nearest codes are its codes, so they sit inside each code's interval.
    assert torch.equal(quantize_with(updated, nearest.scales, nearest.zeros, bits, 32), codes.int())


@pytest.mark.parametrize("bits", [3, 4])
def test_learning_lowers_block_error_below_gptq(bits):
    """On planted outliers, every block's output error over the calibration windows drops well below
    the error-feedback codes' (with the learning switched off — one step of a tiny rate — it does not)."""
    model = make_tiny_model("llama")
    plant_outliers(model)
    _, blocks = run(model, bits=bits, **{"awq.rounding": "learned"})
    for b in blocks:  # measured 0.28–0.78 (llama, qwen3; seeds 0, 1; 3 and 4 bits)
        e = b["learned"]
        assert e["kept"] == "learned" and e["loss_learned"] < 0.85 * e["loss_start"], e
    model = make_tiny_model("llama")
    plant_outliers(model)
    _, idle = run(model, bits=bits, **{"awq.rounding": "learned", "learn.steps": 1, "learn.lr": 1e-6})
    assert all(b["learned"]["loss_learned"] > 0.99 * b["learned"]["loss_start"] for b in idle), idle


def test_same_seed_same_codes_and_the_seed_matters():
    def codes(seed):
        q, _ = run(make_tiny_model("qwen2"), **{"awq.rounding": "learned", "learn.steps": 40, "learn.seed": seed})
        return q

    a, b, c = codes(0), codes(0), codes(1)
    assert all(torch.equal(a[n].q, b[n].q) and torch.equal(a[n].scales, b[n].scales) for n in a)
    assert any(not torch.equal(a[n].q, c[n].q) for n in a)


def test_the_guard_keeps_the_gptq_codes_when_learning_makes_them_worse():
    """A rate of half a step at every step throws the rounding about: the block keeps the codes that
    `--rounding gptq` writes, bit for bit, and the report says so."""
    gptq, _ = run(make_tiny_model("llama"), **{"awq.rounding": "gptq"})
    learned, blocks = run(make_tiny_model("llama"), **{"awq.rounding": "learned", "learn.steps": 3, "learn.lr": 0.5})
    assert all(b["learned"]["kept"] == "start" and b["learned"]["loss_learned"] > b["learned"]["loss_start"]
               for b in blocks), blocks
    assert all(torch.equal(gptq[n].q, learned[n].q) and torch.equal(gptq[n].scales, learned[n].scales) for n in gptq)


def test_rtn_learned_starts_from_nearest_and_improves():
    model = make_tiny_model("qwen3")
    plant_outliers(model)
    _, blocks = run(model, method="rtn", **{"awq.rounding": "learned"})
    assert all(b["groups"] == [] for b in blocks)  # no scale search: RTN's scales
    assert all(b["learned"]["kept"] == "learned" and b["learned"]["loss_learned"] < 0.85 * b["learned"]["loss_start"]
               for b in blocks), blocks


@pytest.mark.parametrize("arch,method,fmt,bits", [("llama", "awq", "awq", 4), ("qwen3", "rtn", "compressed-tensors", 4),
                                                  ("qwen2", "awq", "compressed-tensors", 8)])
def test_learned_export_loads_in_the_engine_and_transformers(tiny_models, text_file, tmp_path, arch, method, fmt, bits):
    loaded = load_fp_model(tiny_models[arch])
    config = build_config(method=method, format=fmt, **FAST, **{
        "weight.bits": bits, "calib.samples": 8, "calib.seqlen": 32, "awq.rounding": "learned", "learn.steps": 50})
    res = quantkit.quantize(loaded, config, calib=str(text_file), work_dir=tmp_path / "q", progress=False)
    report = json.loads((res.work_dir / "quant_report.json").read_text())
    entries = [b["learned"] for b in report[method]["blocks"]]
    assert len(entries) == 2 and all(e["steps"] == 50 and e["loss_learned"] > 0 and e["seconds"] > 0 for e in entries)
    assert "learn" in report[method]["phases_s"]
    hf, _ = quantkit.load(res.work_dir, device="cpu", dtype=torch.float32)
    assert_export_is_the_in_memory_model(loaded.model, hf, windows(2, 16, seed=3))
    engine_model, _, _ = load_decoder(res.work_dir, "cpu", torch.float32)
    assert_same_logits(engine_model, hf)


def test_learn_settings_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="--learn-steps 0 is out of range"):
        build_config(method="awq", **{"learn.steps": 0})
    with pytest.raises(ConfigError, match="--learn-lr"):
        build_config(method="awq", **{"learn.lr": -1.0})
    with pytest.raises(ConfigError, match="learned, nearest or gptq"):
        build_config(method="awq", **{"awq.rounding": "adaround"})
    assert build_config(method="rtn", **{"awq.rounding": "learned"}).calibrated
    assert not build_config(method="rtn").calibrated
