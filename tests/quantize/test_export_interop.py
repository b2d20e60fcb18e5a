"""What other engines see in an export: only weight shards at the root, vLLM's fp8 KV scales beside the
compressed-tensors weights (and nowhere else), the KV statistics where quantkit's engine finds them
(new and old layouts), and an `architectures` entry even when the source config had none."""

import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.formats.kv_stats import FILE_NAME, LEGACY_FILE_NAME, read_kv_stats, write_kv_stats
from quantkit.models.loading import LoadedModel
from quantkit.models.registry import spec_for_config
from quantkit.quantize.export import export_config
from quantkit_testing.export_check import rtn_export
from quantkit_testing.tiny import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def exports(tiny_models, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    return {fmt: rtn_export(tiny_models["llama"], text_file, root / fmt, fmt) for fmt in ("awq", "compressed-tensors")}


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_root_holds_only_weight_shards(exports, fmt):
    ckpt = exports[fmt]
    # vLLM, transformers and lmdeploy glob *.safetensors at the root when there is no index.
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert (ckpt / FILE_NAME).is_file() and not (ckpt / LEGACY_FILE_NAME).exists()
    report = json.loads((ckpt / "quant_report.json").read_text())
    assert report["kv_stats"]["file"] == FILE_NAME


def test_compressed_tensors_export_carries_vllm_kv_scales(exports):
    ckpt = exports["compressed-tensors"]
    weights = load_file(str(ckpt / "model.safetensors"))
    raw = load_file(str(ckpt / FILE_NAME))
    for i in range(2):
        for kind in "kv":
            # Independently: the layer's largest |value| over heads and channels, onto fp8 e4m3's 448.
            absmax = max(raw[f"{kind}_min"][i].abs().max().item(), raw[f"{kind}_max"][i].abs().max().item())
            scale = weights[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (1,)
            assert scale.item() == pytest.approx(absmax / 448.0, rel=1e-6)
    assert len([k for k in weights if k.endswith(("k_scale", "v_scale"))]) == 4
    scheme = json.loads((ckpt / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert {k: scheme[k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")} == {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_awq_export_has_no_kv_scales(exports):
    ckpt = exports["awq"]
    assert not [k for k in load_file(str(ckpt / "model.safetensors")) if k.endswith(("k_scale", "v_scale"))]
    assert "kv_cache_scheme" not in json.loads((ckpt / "config.json").read_text())["quantization_config"]


def test_compressed_tensors_export_without_stats_declares_no_kv_scheme(tiny_models, tmp_path):
    cfg = QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32), format="compressed-tensors")
    ckpt = quantkit.quantize(str(tiny_models["llama"]), cfg, work_dir=tmp_path / "q", progress=False).work_dir
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert not [k for k in load_file(str(ckpt / "model.safetensors")) if k.endswith(("k_scale", "v_scale"))]


@pytest.mark.parametrize("layout", ["new", "old"])
def test_runtime_finds_static_stats_in_both_layouts(exports, tmp_path, layout):
    import shutil

    ckpt = shutil.copytree(exports["compressed-tensors"], tmp_path / "ckpt")
    expected = read_kv_stats(ckpt)
    if layout == "old":  # a checkpoint written before the statistics moved into quantkit/
        (ckpt / FILE_NAME).rename(ckpt / LEGACY_FILE_NAME)
        (ckpt / FILE_NAME).parent.rmdir()
    from quantkit.engine import Engine, EngineConfig, SamplingParams
    from quantkit.kernels.paged_kv import static_scales

    engine = Engine(ckpt, EngineConfig(device="cpu", num_kv_tokens=64, kv_bits=8, kv_scales="static"))
    for i, pool in enumerate(engine.runner.kv_caches):
        want = static_scales(expected.k_min[i], expected.k_max[i], expected.v_min[i], expected.v_max[i], 8)
        assert all(torch.equal(got, w) for got, w in zip(pool.static, want))
    (out,) = engine.generate(["the cache keeps keys"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                             progress=False)
    assert len(out.token_ids) == 2


def test_rewriting_stats_moves_an_old_layout_out_of_the_weight_namespace(exports, tmp_path):
    import shutil

    ckpt = shutil.copytree(exports["awq"], tmp_path / "ckpt")
    stats = read_kv_stats(ckpt)
    (ckpt / FILE_NAME).rename(ckpt / LEGACY_FILE_NAME)
    assert write_kv_stats(stats, ckpt) == ckpt / FILE_NAME  # what `quantkit kv-calibrate CKPT` does
    assert not (ckpt / LEGACY_FILE_NAME).exists()
    assert torch.equal(read_kv_stats(ckpt).k_absmax, stats.k_absmax)


def test_architectures_filled_in_when_the_source_config_has_none():
    model = make_tiny_model("llama")
    model.config.architectures = None  # as transformers leaves it for a model read from a .gguf
    loaded = LoadedModel(model, make_tokenizer(), spec_for_config(model.config), "model.gguf")
    cfg = export_config(loaded, QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32)))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    model.config.architectures = ["SomethingElse"]  # one that is present is kept
    assert export_config(loaded, QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32)))["architectures"] == ["SomethingElse"]
