"""Round trip: quantize → packed checkpoint → quantkit.load gives the logits of quantize→dequantize weights."""

import json

import pytest
import torch

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.formats.awq_gemm import unpack_awq_gemm
from quantkit.formats.checkpoint import CheckpointError, read_safetensors
from quantkit.models.loading import load_fp_model
from quantkit.nn import QuantLinear
from quantkit.quantize.primitives import pseudo_quantize, quantize_weight

SCHEMES = {
    "w4g32-awq": QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32)),
    "w8-int8": QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)),
    "w4g64-ct": QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 64), format="compressed-tensors"),
}


def reference_logits(src, cfg, ids):
    """The same model with every block linear replaced by quantize→dequantize, evaluated in fp32."""
    ref = load_fp_model(src, dtype=torch.float16)
    ref.model.float()
    with torch.no_grad():
        for i, layer in enumerate(ref.model.get_submodule(ref.spec.layers_path)):
            for name in ref.spec.linears:
                lin = layer.get_submodule(name)
                lin.weight.copy_(pseudo_quantize(lin.weight.half().float(), cfg.weight))
        return ref.model(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "internlm2"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_round_trip_logits(tiny_models, tmp_path, arch, scheme):
    cfg = SCHEMES[scheme]
    out = quantkit.quantize(str(tiny_models[arch]), cfg, work_dir=tmp_path / "q", progress=False).work_dir
    model, tok = quantkit.load(out, device="cpu")
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert n_quant == 2 * 7
    assert not isinstance(model.lm_head, QuantLinear)
    ids = torch.randint(3, 300, (2, 16))
    with torch.no_grad():
        got = model(ids).logits
    want = reference_logits(tiny_models[arch], cfg, ids)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM" if arch == "internlm2" else model.config.architectures[0]]
    report = json.loads((out / "quant_report.json").read_text())
    assert report["method"] == cfg.method and report["wall_time_s"] > 0 and "torch" in report["versions"]


def test_awq_tensors_unpack_to_the_integers(tiny_models, tmp_path):
    cfg = SCHEMES["w4g32-awq"]
    out = quantkit.quantize(str(tiny_models["llama"]), cfg, work_dir=tmp_path / "q", progress=False).work_dir
    sd = read_safetensors(out)
    fp = load_fp_model(tiny_models["llama"], dtype=torch.float16)
    name = "model.layers.1.mlp.down_proj"
    expected = quantize_weight(fp.model.get_submodule(name).weight.float(), cfg.weight)
    q, z, s = unpack_awq_gemm(sd[f"{name}.qweight"], sd[f"{name}.qzeros"], sd[f"{name}.scales"])
    assert torch.equal(q, expected.q) and torch.equal(z, expected.zeros)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": ["lm_head"]}


def test_works_inside_transformers_pipeline(tiny_models, tmp_path):
    from transformers import pipeline

    out = quantkit.quantize(str(tiny_models["qwen2"]), SCHEMES["w4g32-awq"], work_dir=tmp_path / "q", progress=False).work_dir
    model, tok = quantkit.load(out, device="cpu")
    gen = pipeline("text-generation", model=model, tokenizer=tok)
    text = gen("the model", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("the model") and len(text) > len("the model")


def test_not_a_checkpoint(tiny_models, tmp_path):
    with pytest.raises(CheckpointError, match="not a quantized checkpoint"):
        quantkit.load(tiny_models["llama"])
    with pytest.raises(CheckpointError, match="does not exist"):
        quantkit.load(tmp_path / "nothing")


AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def config_dir(tmp_path, text):
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(text if isinstance(text, str) else json.dumps(text))
    return d


@pytest.mark.parametrize("qc,needle", [
    ({**AWQ_QC, "version": "gemv"}, "AWQ version 'gemv' is not supported, only 'gemm'"),
    ({**AWQ_QC, "version": "gemv_fast"}, "AWQ version 'gemv_fast' is not supported"),
    ({**AWQ_QC, "bits": 3}, "AWQ with 3 bits is not supported"),
    ({"quant_method": "compressed-tensors", "format": "sparse-bitmask"}, "format 'sparse-bitmask' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}},
     "strategy 'block' are not supported"),
])
def test_layouts_it_cannot_run_are_refused_at_load(tmp_path, qc, needle):
    d = config_dir(tmp_path, {"model_type": "llama", "quantization_config": qc})
    with pytest.raises(CheckpointError, match=needle):
        quantkit.load(d, device="cpu")


def test_awq_gemm_in_any_case_or_unnamed_is_read(tmp_path):
    from quantkit.runtime.loader import read_quant_config

    for qc in ({**AWQ_QC, "version": "GEMM"}, {k: v for k, v in AWQ_QC.items() if k != "version"}):
        assert read_quant_config(config_dir(tmp_path, {"quantization_config": qc}))["bits"] == 4


def test_broken_config_json_is_one_error(tmp_path):
    d = config_dir(tmp_path, '{"model_type": "llama",')
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(.* at line 1\)"):
        quantkit.load(d, device="cpu")
    config_dir(tmp_path, {"model_type": "no-such-model", "quantization_config": AWQ_QC})
    with pytest.raises(CheckpointError, match="cannot be read by transformers: .*no-such-model") as exc:
        quantkit.load(d, device="cpu")
    assert "\n" not in str(exc.value)


def test_cuda_asked_without_cuda(tmp_path, monkeypatch):
    from quantkit.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    d = config_dir(tmp_path, {"model_type": "llama", "quantization_config": AWQ_QC})
    with pytest.raises(ConfigError, match="--device cuda: this machine has no CUDA GPU .* use --device cpu"):
        quantkit.load(d, device="cuda")
