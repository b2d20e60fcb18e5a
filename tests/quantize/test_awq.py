"""AWQ on tiny models: folding keeps the fp function, on planted outlier channels the whole driver
cuts RTN's logit error, NaN guards, and every registry family round-trips quantize → export →
quantkit.load with the in-memory logits. The searches alone, measured: test_search.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import quantkit
from quantkit.config import build_config
from quantkit.models.loading import load_fp_model
from quantkit.quantize import awq as awq_mod
from quantkit.quantize.folding import HeadTying, fold_scales
from quantkit_testing.export_check import assert_export_is_the_in_memory_model
from quantkit_testing.tiny import make_tiny_model
from quantkit_testing.in_memory import awq_quantize

FAST = {"awq.n_grid": 8, "awq.search_tokens": 64, "calib.batch_size": 4, "weight.group_size": 32}


def windows(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def run_awq(model, **overrides):
    from quantkit.models.registry import spec_for_config

    report: dict = {}
    config = build_config(method="awq", **{**FAST, **overrides})
    qweights = awq_quantize(model, spec_for_config(model.config), config, windows(), report, progress=False)
    return qweights, report["awq"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folding_keeps_the_fp_function(arch, monkeypatch):
    """With quantization switched off, the searched scales are folded and the logits stay the same."""
    model = make_tiny_model(arch)  # fp32, so only rounding of the folds themselves can differ
    ids = windows(2, 24, seed=1)
    with torch.no_grad():
        before = model(ids).logits
    monkeypatch.setattr(awq_mod, "finalize_block", lambda *a, **k: ({}, {}))
    _, info = run_awq(model, **{"awq.propagate": "fp"})
    folded = [g for b in info["blocks"] for g in b["groups"] if not g["fallback"]]
    assert len(folded) >= 4, info["fallbacks"]  # scales really were applied, v→o under GQA included
    assert any(g.get("tied_heads") == 2 for g in folded)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_gqa_fold_matches_attention_output():
    """A v→o fold under GQA leaves o(attention(v)) unchanged for random scales (not just searched ones)."""
    torch.manual_seed(0)
    kv, g, hd, hidden = 2, 3, 4, 16
    v = torch.nn.Linear(hidden, kv * hd, bias=True)
    o = torch.nn.Linear(kv * g * hd, hidden, bias=False)
    x = torch.randn(5, hidden)

    def out():  # each query head reads its kv head's values (repeat_kv)
        vals = v(x).reshape(5, kv, 1, hd).expand(5, kv, g, hd).reshape(5, -1)
        return o(vals)

    ref = out()
    tying = HeadTying(kv, g, hd)
    s = torch.rand(kv * hd) + 0.5
    with torch.no_grad():
        fold_scales(v, [o], s, tying.expand(s))
    torch.testing.assert_close(out(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_block_report_names_every_search(arch):
    qweights, info = run_awq(make_tiny_model(arch).half())
    assert len(qweights) == 2 * 7
    searched = [g for b in info["blocks"] for g in b["groups"] if "loss" in g]
    assert len(searched) == 8 and all(math.isfinite(g["loss"]) and math.isfinite(g["loss_rtn"]) for g in searched)
    for b in info["blocks"]:
        clipped = {name for name, c in b["linears"].items() if "loss_noclip" in c}
        assert clipped == {"self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert {"capture", "forward", "search", "clip+quantize"} <= set(info["phases_s"])


def plant_loud_channels(model, gain: float = 30.0, per_norm: int = 3, seed: int = 0) -> None:
    """Make a few channels of every block's norms `gain` times louder: the salient inputs AWQ protects."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(hidden, generator=g)[:per_norm]] *= gain


@pytest.mark.parametrize("seed", [0, 1])
def test_awq_beats_rtn_on_loud_channels(seed):
    """The whole driver (statistics, scale search, folding) on a model with planted loud channels:
    the logit error of the AWQ model is well below that of plain RTN, and every norm group chose α > 0.
    Nearest rounding and no clip, so the scales alone make the difference."""
    model = make_tiny_model("llama", seed)  # fp32: the errors compared are the quantization's
    plant_loud_channels(model, seed=seed)
    from quantkit.models.registry import spec_for_config
    from quantkit.quantize.primitives import quantize_weight

    spec = spec_for_config(model.config)
    ids = windows(4, 32, seed=7)  # held out: the calibration windows use seed 0
    rtn = copy.deepcopy(model)
    cfg = build_config(method="awq", **{**FAST, "awq.clip": False, "awq.rounding": "nearest"})
    with torch.no_grad():
        want = model(ids).logits
        for layer in rtn.model.layers:
            for name in spec.linears:
                lin = layer.get_submodule(name)
                lin.weight.copy_(quantize_weight(lin.weight, cfg.weight).dequantize())
        rtn_error = float((rtn(ids).logits - want).pow(2).mean())
    report: dict = {}
    awq_quantize(model, spec, cfg, windows(), report, progress=False)  # leaves the dequantized weights
    with torch.no_grad():
        awq_error = float((model(ids).logits - want).pow(2).mean())
    norm_groups = [g for b in report["awq"]["blocks"] for g in b["groups"] if g["prev"].endswith("layernorm")]
    assert len(norm_groups) == 4 and all((g.get("ratio") or 0) > 0 for g in norm_groups), norm_groups
    # Measured 0.42 and 0.52 of RTN's error (seeds 0, 1); with the scale search off it is 1.0.
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)


def test_nan_activations_fall_back_to_rtn():
    model = make_tiny_model("llama").half()
    with torch.no_grad():
        model.model.embed_tokens.weight[windows()[0, 0]] = float("nan")
    qweights, info = run_awq(model)
    assert any("NaN" in f for f in info["fallbacks"])
    for qw in qweights.values():
        assert torch.isfinite(qw.scales).all() and torch.isfinite(qw.dequantize()).all()


@pytest.mark.parametrize("arch,fmt", [("llama", "awq"), ("mistral", "awq"), ("qwen2", "awq"), ("qwen3", "compressed-tensors"),
                                      ("internlm2", "awq")])
def test_export_loads_with_in_memory_logits(tiny_models, text_file, tmp_path, arch, fmt):
    loaded = load_fp_model(tiny_models[arch])
    config = build_config(method="awq", format=fmt, **FAST, **{"calib.samples": 8, "calib.seqlen": 32})
    res = quantkit.quantize(loaded, config, calib=str(text_file), work_dir=tmp_path / "q", progress=False)
    model, _ = quantkit.load(res.work_dir, device="cpu", dtype=torch.float32)
    assert_export_is_the_in_memory_model(loaded.model, model, windows(2, 16, seed=3))
    report = json.loads((res.work_dir / "quant_report.json").read_text())
    blocks = report["awq"]["blocks"]
    assert len(blocks) == 2 and all(math.isfinite(b["loss"]) for b in blocks)
    assert report["calibration"]["samples"] == 8
    if arch == "internlm2":  # its registry entry has no v→o group: the safe groups only
        assert [g["prev"] for g in blocks[0]["groups"]] == ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]


def test_cli_awq(tiny_models, text_file, tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import app

    out = tmp_path / "cli"
    result = CliRunner().invoke(app, [
        "awq", str(tiny_models["qwen2"]), "--work-dir", str(out), "--w-bits", "4", "--group-size", "32",
        "--calib-dataset", str(text_file), "--calib-samples", "4", "--calib-seqlen", "32", "--n-grid", "4",
        "--no-duo-scaling", "--no-clip", "--batch-size", "2", "--device", "cpu", "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quant_report.json").read_text())
    assert report["method"] == "awq" and report["config"]["awq"]["clip"] is False
    assert report["config"]["awq"]["duo_scaling"] is False and report["calibration"]["samples"] == 4
    assert all("loss" not in e for b in report["awq"]["blocks"] for e in b["linears"].values())


@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quantize_is_the_checkpoint_rounding(symmetric):
    from quantkit.config import WeightQuantConfig
    from quantkit.quantize.primitives import quantize_weight
    from quantkit.quantize.search import fake_quantize

    torch.manual_seed(1)
    w = torch.randn(48, 128) * torch.rand(1, 128) * 3
    cfg = WeightQuantConfig(4, 32, symmetric)
    g = w.reshape(48, 4, 32)
    mx, mn = g.amax(-1) * 0.8, g.amin(-1) * 0.7
    assert torch.equal(fake_quantize(w, cfg), quantize_weight(w, cfg).dequantize())
    assert torch.equal(fake_quantize(w, cfg, mx, mn), quantize_weight(w, cfg, mx, mn).dequantize())


def test_gptq_rounding_lowers_output_error_and_reduces_to_rtn_without_correlation():
    from quantkit.config import WeightQuantConfig
    from quantkit.quantize.primitives import quantize_weight
    from quantkit.quantize.rounding import gptq_codes, output_error

    torch.manual_seed(2)
    cfg = WeightQuantConfig(4, 32)
    w = torch.randn(24, 64)
    qw = quantize_weight(w, cfg)
    # Uncorrelated inputs of equal power: nothing to feed back, the codes are the nearest ones.
    eye = torch.eye(64) * 5.0
    assert torch.equal(gptq_codes(w, eye, qw.scales, qw.zeros, 4, 32), qw.q)
    # Correlated inputs: the output error drops below nearest rounding's, codes stay in range.
    x = torch.randn(512, 8) @ torch.randn(8, 64) + 0.1 * torch.randn(512, 64)
    h = x.t() @ x
    codes = gptq_codes(w, h, qw.scales, qw.zeros, 4, 32)
    assert codes.min() >= 0 and codes.max() <= 15
    from quantkit.quantize.primitives import dequantize

    assert output_error(w, dequantize(codes, qw.zeros, qw.scales, 32), h) < 0.8 * output_error(w, qw.dequantize(), h)


def test_gptq_rounding_round_trips(tiny_models, text_file, tmp_path):
    loaded = load_fp_model(tiny_models["qwen2"])
    config = build_config(method="awq", **FAST, **{"calib.samples": 8, "calib.seqlen": 32, "awq.rounding": "gptq"})
    res = quantkit.quantize(loaded, config, calib=str(text_file), work_dir=tmp_path / "q", progress=False)
    entries = [e for b in res.report["awq"]["blocks"] for e in b["linears"].values()]
    assert len(entries) == 14 and all(e["out_err_gptq"] <= e["out_err_nearest"] * 1.5 for e in entries)
    model, _ = quantkit.load(res.work_dir, device="cpu", dtype=torch.float32)
    assert_export_is_the_in_memory_model(loaded.model, model, windows(2, 16, seed=4))
