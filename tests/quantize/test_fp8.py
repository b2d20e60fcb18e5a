"""`quantkit fp8` on tiny models: weights absmax/448 onto e4m3, the export in llm-compressor's layout,
static input scales the largest |input| each linear sees, and the export running alike in the engine,
quantkit.load and transformers (with compressed-tensors), close to the fp model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.config import build_config
from quantkit.engine.model import load_decoder
from quantkit.models.loading import load_fp_model
from quantkit.nn import Fp8Linear
from quantkit.quantize.fp8 import quantize_fp8_weight
from quantkit_testing.decoder_check import assert_same_logits, hf_model
from quantkit_testing.export_check import assert_export_is_the_in_memory_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
SCHEMES = {"dynamic-channel": ("dynamic", "channel"), "static-tensor": ("static", "tensor"),
           "dynamic-tensor": ("dynamic", "tensor"), "static-channel": ("static", "channel"),
           "dynamic-channel-gptq": ("dynamic", "channel", "gptq"), "static-tensor-gptq": ("static", "tensor", "gptq"),
           "dynamic-tensor-gptq": ("dynamic", "tensor", "gptq")}


def windows(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def fp8_config(scheme: str, strategy: str, rounding: str = "nearest"):
    return build_config(method="fp8", fp8={"scheme": scheme, "weight_strategy": strategy, "rounding": rounding},
                        calib={"samples": 8, "seqlen": 32, "batch_size": 4})


def calibrated(name: str) -> bool:
    return SCHEMES[name][0] == "static" or SCHEMES[name][2:] == ("gptq",)


@pytest.fixture(scope="module")
def exports(tiny_models, tmp_path_factory):
    """{(arch, scheme name): export directory}, made once (the static ones calibrated on `windows()`)."""
    root = tmp_path_factory.mktemp("fp8")
    cache = {}

    def get(arch: str, name: str):
        if (arch, name) not in cache:
            cache[arch, name] = quantkit.quantize(str(tiny_models[arch]), fp8_config(*SCHEMES[name]),
                                                  calib=windows() if calibrated(name) else None,
                                                  work_dir=root / f"{arch}-{name}", progress=False).work_dir
        return cache[arch, name]
    return get


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_weight_scale_is_absmax_over_448(strategy):
    torch.manual_seed(0)
    w = torch.randn(16, 64) * torch.rand(16, 1)
    qw = quantize_fp8_weight(w, strategy)
    absmax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    assert qw.q.dtype == torch.float8_e4m3fn and qw.scales.dtype == torch.float32
    assert qw.scales.shape == absmax.shape and torch.allclose(qw.scales, absmax / 448)
    q = qw.q.float()
    if strategy == "channel":
        assert (q.abs().amax(dim=1) == 448).all()  # every row's largest weight is the grid's end
    else:
        assert q.abs().max() == 448
    deq = qw.dequantize()
    assert ((deq - w).abs() <= w.abs() / 16 + qw.scales.reshape(-1, 1) * 2.0**-10).all()
    assert (deq - w).abs().max() > 0  # really rounded


@pytest.mark.parametrize("name", ["dynamic-channel", "static-tensor", "dynamic-tensor-gptq"])
def test_export_is_llm_compressors_layout(exports, name):
    scheme, strategy = SCHEMES[name][:2]
    ckpt = exports("llama", name)
    t = load_file(str(ckpt / "model.safetensors"))
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            w = t.pop(f"{p}.weight")
            out_f = w.shape[0]
            assert w.dtype == torch.float8_e4m3fn
            s = t.pop(f"{p}.weight_scale")
            assert s.dtype == torch.float32 and s.shape == ((out_f, 1) if strategy == "channel" else (1,))
            if scheme == "static":
                a = t.pop(f"{p}.input_scale")
                assert a.dtype == torch.float32 and a.shape == (1,) and a.item() > 0
    # The rest is full precision: embeddings, lm_head, norms (and vLLM's KV scales where statistics were taken).
    rest = {k for k in t if not k.endswith(("k_scale", "v_scale"))}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= rest
    assert all(t[k].dtype == torch.float16 for k in rest)
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == strategy and group["input_activations"]["dynamic"] == (scheme == "dynamic")
    report = json.loads((ckpt / "quant_report.json").read_text())
    assert report["method"] == "fp8" and report["format"] == "float-quantized"
    assert report["fp8"]["scheme"] == scheme and report["config"]["fp8"]["weight_strategy"] == strategy
    assert report["fp8"]["rounding"] == (SCHEMES[name][2:] or ("nearest",))[0]
    assert (report["calibration"] is None) == (not calibrated(name))


def test_static_input_scale_is_the_largest_input_over_448(tiny_models, tmp_path):
    """Measured independently: the in-memory quantized model (FP8 weights) run on the calibration windows."""
    loaded = load_fp_model(tiny_models["llama"], dtype=torch.float32)
    calib = windows()
    res = quantkit.quantize(loaded, fp8_config("static", "channel"), calib=calib, work_dir=tmp_path / "q",
                            progress=False)
    model = loaded.model.float().eval()
    seen: dict[str, float] = {}
    hooks = [model.get_submodule(f"model.layers.{i}.{lin}").register_forward_pre_hook(
        lambda m, args, key=f"model.layers.{i}.{lin}": seen.__setitem__(key, max(seen.get(key, 0.0),
                                                                                  args[0].abs().max().item())))
        for i in range(2) for lin in LINEARS]
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    t = load_file(str(res.work_dir / "model.safetensors"))
    for key, absmax in seen.items():
        assert t[f"{key}.input_scale"].item() == pytest.approx(absmax / 448, rel=1e-5), key


@pytest.mark.parametrize("name", ["dynamic-channel", "static-tensor", "static-tensor-gptq"])
def test_export_is_the_in_memory_weights(tiny_models, tmp_path, name):
    loaded = load_fp_model(tiny_models["qwen2"])  # fp16, as the export's unquantized tensors
    res = quantkit.quantize(loaded, fp8_config(*SCHEMES[name]), calib=windows() if calibrated(name) else None,
                            work_dir=tmp_path / "q", progress=False)
    exported, _ = quantkit.load(res.work_dir, device="cpu", dtype=torch.float32)
    # The in-memory model has FP8 weights but unquantized activations: compare with the export's activations
    # left alone too (dynamic quantization off), which isolates the weights.
    for module in exported.modules():
        if isinstance(module, Fp8Linear):
            module.forward = lambda x, m=module: torch.nn.functional.linear(
                x, m.dequantized_weight(), None if m.bias is None else m.bias.float())
    assert_export_is_the_in_memory_model(loaded.model, exported, windows(2, 16, seed=3))


@pytest.mark.parametrize("arch,name", [("llama", "dynamic-channel"), ("llama", "static-tensor"),
                                       ("qwen2", "dynamic-tensor"), ("qwen2", "static-channel"),
                                       ("llama", "dynamic-channel-gptq"), ("qwen2", "static-tensor-gptq")])
def test_engine_runs_what_quantkit_load_runs(exports, arch, name):
    ckpt = exports(arch, name)
    model, _, _ = load_decoder(ckpt, "cpu", torch.float32)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    assert (layer.self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    hf, _ = quantkit.load(ckpt, device="cpu")
    assert isinstance(hf.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert_same_logits(model, hf)


def test_logits_close_to_the_fp_model(tiny_models, exports, tmp_path):
    """Closer than 4-bit RTN (g32) by a wide margin (e4m3 keeps 3 mantissa bits), yet really quantized."""
    ids = windows(4, 32, seed=5)
    with torch.no_grad():
        want = hf_model(tiny_models["llama"])(ids).logits

    def error(ckpt):
        q, _ = quantkit.load(ckpt, device="cpu")
        with torch.no_grad():
            got = q(ids).logits
        return ((got - want).abs().mean() / want.abs().mean()).item(), (got.argmax(-1) == want.argmax(-1)).float().mean().item()

    w4 = quantkit.quantize(str(tiny_models["llama"]), build_config(method="rtn", weight={"group_size": 32}),
                           work_dir=tmp_path / "w4", progress=False).work_dir
    err_w4, _ = error(w4)
    for name in ("dynamic-channel", "static-tensor", "dynamic-channel-gptq", "static-tensor-gptq"):
        err, agree = error(exports("llama", name))
        assert 1e-4 < err < err_w4 / 2 and agree > 0.75, (name, err, err_w4, agree)


@pytest.mark.parametrize("name", ["dynamic-channel", "static-tensor"])
def test_transformers_with_compressed_tensors_loads_it(exports, name):
    pytest.importorskip("compressed_tensors")
    ckpt = exports("llama", name)
    model, _, _ = load_decoder(ckpt, "cpu", torch.float32)
    hf = hf_model(ckpt)  # transformers' own loader, compressed-tensors decompressing the FP8 weights
    q_proj = hf.model.layers[0].self_attn.q_proj
    assert getattr(q_proj, "quantization_scheme", None) is not None  # it applies the scheme, activations too
    assert_same_logits(model, hf)


def test_fp8_refuses_integer_weight_settings_and_needs_text_when_static(tiny_models, tmp_path):
    from quantkit.config import ConfigError, UserError

    with pytest.raises(ConfigError, match="fp8 takes no integer weight settings"):
        build_config(method="fp8", weight={"bits": 4})
    with pytest.raises(ConfigError, match="--format awq with method fp8"):
        build_config(method="fp8", format="awq")
    with pytest.raises(ConfigError, match="float-quantized with method rtn"):
        build_config(method="rtn", format="float-quantized")
    # Unset, the rounding is GPTQ where the scheme reads calibration text anyway, nearest where it needs none.
    assert build_config(method="fp8", fp8={"scheme": "static"}).fp8.rounding == "gptq"
    dynamic = build_config(method="fp8")
    assert dynamic.fp8.rounding == "nearest" and not dynamic.calibrated
    assert build_config(method="fp8", fp8={"rounding": "gptq"}).calibrated
    with pytest.raises(ConfigError, match="--rounding 'learned' is not supported for fp8"):
        build_config(method="fp8", fp8={"rounding": "learned"})
    for scheme, rounding in (("static", "nearest"), ("dynamic", "gptq")):
        with pytest.raises(UserError):
            quantkit.quantize(str(tiny_models["llama"]), fp8_config(scheme, "tensor", rounding), calib=None,
                              work_dir=tmp_path / "q", progress=False)
        assert not (tmp_path / "q").exists() or not any((tmp_path / "q").iterdir())


@pytest.mark.parametrize("name, shown", [("dynamic-channel", "channel"), ("dynamic-tensor", "tensor")])
def test_reports_show_the_weight_scale_granularity(exports, name, shown):
    """The comparison table's group column says per channel or per tensor, as the export records it."""
    from quantkit.eval.loading import load_engine_model
    from quantkit.eval.report import _group

    em = load_engine_model(exports("llama", name), "cpu")
    assert (em.method, em.bits) == ("fp8", 8)
    assert _group(em) == shown


def correlated_problem(seed: int, out_f: int = 48, in_f: int = 96):
    """W [out, in] with rows of unequal size and outliers, and H = XᵀX of inputs that share a few directions."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    w[torch.randint(0, out_f, (4,), generator=g), torch.randint(0, in_f, (4,), generator=g)] *= 8
    x = torch.randn(1024, 12, generator=g) @ torch.randn(12, in_f, generator=g) + 0.2 * torch.randn(1024, in_f, generator=g)
    x[:, :4] *= 10  # a few loud channels, as LLM activations have
    return w, x.t() @ x


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_gptq_on_the_e4m3_grid_lowers_the_output_error(strategy):
    """Error feedback (no guard) against nearest rounding under the same absmax/448 scale, on random problems:
    never worse, clearly better on the whole; codes are e4m3 values within ±448."""
    from quantkit.quantize.rounding import gptq_round, output_error

    ratios = []
    for seed in range(6):
        w, h = correlated_problem(seed)
        nearest = quantize_fp8_weight(w, strategy)
        scales, zeros, grid = nearest.grid()
        assert grid == "e4m3" and scales.shape == (w.shape[0], 1) and not zeros.any()
        codes = gptq_round(w, h, scales, zeros, grid, w.shape[1])
        assert torch.isfinite(codes).all() and codes.abs().max() <= 448
        assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)  # on the grid: the cast keeps them
        gptq = nearest.with_codes(codes)
        assert gptq.q.dtype == torch.float8_e4m3fn and torch.equal(gptq.scales, nearest.scales)
        err_gptq, err_nearest = output_error(w, gptq.dequantize(), h), output_error(w, nearest.dequantize(), h)
        assert err_gptq <= err_nearest, (seed, err_gptq, err_nearest)
        ratios.append(err_gptq / err_nearest)
    assert sum(ratios) / len(ratios) < 0.7, ratios


def test_gptq_on_the_e4m3_grid_is_nearest_without_correlation():
    """With uncorrelated inputs there is nothing to feed back: the codes are the nearest ones, bit for bit."""
    from quantkit.quantize.rounding import gptq_round

    w, _ = correlated_problem(7)
    nearest = quantize_fp8_weight(w, "channel")
    codes = gptq_round(w, torch.eye(w.shape[1]) * 3.0, *nearest.grid(), w.shape[1])
    assert torch.equal(codes.to(torch.float8_e4m3fn).view(torch.uint8), nearest.q.view(torch.uint8))


def test_gptq_export_keeps_the_scales_and_changes_the_codes(exports):
    """Same scales as nearest rounding (only the codes move), and the report's summed output error Σ δᵀHδ
    is lower with error feedback."""
    nearest = load_file(str(exports("llama", "dynamic-tensor") / "model.safetensors"))
    gptq = load_file(str(exports("llama", "dynamic-tensor-gptq") / "model.safetensors"))
    changed = 0
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            assert torch.equal(gptq[f"{p}.weight_scale"], nearest[f"{p}.weight_scale"])
            changed += int((gptq[f"{p}.weight"].view(torch.uint8) != nearest[f"{p}.weight"].view(torch.uint8)).any())
    assert changed >= 10
    info = json.loads((exports("llama", "dynamic-tensor-gptq") / "quant_report.json").read_text())["fp8"]
    err = info["output_error"]
    assert err["linears"] == 14 and err["kept"] >= 10 and 0 < err["gptq"] < 0.9 * err["nearest"]
    assert info["fallbacks"] == []


def test_e4m3_codes_saturate_at_448():
    """Fed-back errors can push a weight past the scale's range; its code is ±448 then (a bare cast gives NaN)."""
    from quantkit.quantize.rounding import nearest_code

    x = torch.tensor([500.0, -1000.0, 3.3, 449.0, -0.0])
    assert torch.equal(nearest_code(x.clone(), torch.zeros(5), "e4m3"), torch.tensor([448.0, -448.0, 3.25, 448.0, 0.0]))
    assert torch.equal(nearest_code(torch.tensor([3.3, 20.0]), torch.tensor([8.0, 8.0]), 15), torch.tensor([11.0, 15.0]))
