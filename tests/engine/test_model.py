"""The engine's decoder against transformers: packed prefill of prompts of different lengths over a
paged KV cache, then decode steps one token at a time, for every family and rope scaling; quantkit
exports against quantkit.load's transformers model of the same files."""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit_testing.decoder_check import assert_same_logits, engine_logits, engine_step, hf_model, make_prompts
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.engine.model import load_decoder
from quantkit.engine.weights import quant_linear
from quantkit.formats.awq_gemm import pack_awq_gemm
from quantkit.formats.compressed_tensors import pack_compressed
from quantkit.formats.layout import WeightLayout
from quantkit.formats.registry import FORMATS
from quantkit.kernels import reference
from quantkit.nn import QuantLinear
from quantkit_testing.tiny import TINY, make_tiny_model, make_tokenizer


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_families_match_transformers(tiny_models, arch):
    model, tok, gen = load_decoder(tiny_models[arch], "cpu", torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch in ("qwen2", "qwen3"))
    assert gen.eos_token_id == 2 and tok("the model")["input_ids"]
    assert_same_logits(model, hf_model(tiny_models[arch]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_follows_float32(tiny_models, dtype):
    """Weights, biases, norms and the KV pool in the model's dtype (errors of one rounding step, not more)."""
    prompts, decode = make_prompts()
    with torch.no_grad():
        half, _, _ = load_decoder(tiny_models["qwen2"], "cpu", dtype)
        assert half.dtype == dtype and half.model.layers[0].self_attn.qkv_proj.bias.dtype == dtype
        got = engine_logits(half, prompts, decode)
        want = engine_logits(load_decoder(tiny_models["qwen2"], "cpu", torch.float32)[0], prompts, decode)
    tol = 5e-3 if dtype == torch.float16 else 4e-2
    for g_seq, w_seq in zip(got, want):
        for g, w in zip(g_seq, w_seq):
            assert (g - w).abs().max() / w.abs().max() <= tol


def test_internlm2_original_layout(tiny_models):
    """The InternLM2 checkpoint holds the tiny llama's weights in wqkv/w1/w2/w3 form: same logits."""
    model, _, _ = load_decoder(tiny_models["internlm2"], "cpu", torch.float32)
    assert_same_logits(model, hf_model(tiny_models["llama"]))


def test_prefill_without_a_cache_matches_transformers(tiny_models):
    """Before the runner allocates the KV pool (its warm-up forward), layers attend over the step's own K/V."""
    model, _, _ = load_decoder(tiny_models["qwen3"], "cpu", torch.float32)
    prompts, _ = make_prompts()
    tables = torch.zeros(len(prompts), 2, dtype=torch.int32)
    with torch.no_grad():
        got = engine_step(model, tables, prompts, [0] * len(prompts), decode=False)
        hf = hf_model(tiny_models["qwen3"])
        for g, p in zip(got, prompts):
            w = hf(p[None]).logits[0]
            assert (g - w).abs().max() / w.abs().max() <= 1e-4


def test_unsupported_rope_type_is_a_user_error():
    from transformers import LlamaConfig

    from quantkit.config import UserError
    from quantkit.engine.layers import RotaryEmbedding

    config = LlamaConfig(**{**TINY, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    with pytest.raises(UserError, match="rope type 'longrope' is not supported"):
        RotaryEmbedding(config, 256)


ROPE = {
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    # positions past max_position_embeddings, where dynamic NTK changes the base with the sequence's length
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                    max_position_embeddings=16),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 10000.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("rope", list(ROPE))
def test_rope_scaling_matches_transformers(tmp_path, rope):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**TINY, "tie_word_embeddings": False, **ROPE[rope]})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(make_tiny_model("llama").state_dict())
    hf.save_pretrained(str(tmp_path))
    make_tokenizer().save_pretrained(str(tmp_path))
    model, _, _ = load_decoder(tmp_path, "cpu", torch.float32)
    assert model.model.rotary_emb.dynamic == (rope == "dynamic")
    assert_same_logits(model, hf)


EXPORTS = {
    "llama-awq-w4g32": ("llama", QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32))),
    "qwen2-ct-w4g32": ("qwen2", QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32), format="compressed-tensors")),
    "llama-int8": ("llama", QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True))),
}


@pytest.mark.parametrize("export", list(EXPORTS))
def test_quantkit_export_matches_quantkit_load(tiny_models, tmp_path, export):
    arch, cfg = EXPORTS[export]
    out = quantkit.quantize(str(tiny_models[arch]), cfg, work_dir=tmp_path / "q", progress=False).work_dir
    model, _, _ = load_decoder(out, "cpu", torch.float32)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert layer.self_attn.qkv_proj.out_features == (4 + 2 * 2) * 16
    assert (layer.self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    hf, _ = quantkit.load(out, device="cpu")
    assert_same_logits(model, hf)


def _parts(layout: str, outs: tuple[int, ...], in_f: int = 64, group: int = 32):
    g = torch.Generator().manual_seed(1)
    parts = []
    for out_f in outs:
        q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.int32)
        zeros = torch.randint(0, 16, (out_f, in_f // group), generator=g, dtype=torch.int32)
        scales = torch.rand(out_f, in_f // group, generator=g) * 0.1 + 0.01
        if layout == "awq":
            parts.append(pack_awq_gemm(q, zeros, scales))
        else:
            parts.append(pack_compressed(q, zeros, scales, 4, symmetric=False))
        parts[-1]["bias"] = torch.randn(out_f, generator=g)
    return parts


def _dequantized(tensors: dict, layout: str, group: int = 32) -> torch.Tensor:
    if layout == "awq":
        return reference.dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    out_f, in_f = tensors["weight_shape"].tolist()
    return reference.dequantize_packed(tensors["weight_packed"], tensors["weight_scale"],
                                       tensors.get("weight_zero_point"), out_f, in_f, 4, group)


@pytest.mark.parametrize("layout,outs", [("awq", (32, 16, 24)), ("packed", (32, 16, 24)), ("packed", (12, 20))])
def test_fused_quant_linear_is_its_parts_stacked(layout, outs):
    """Output rows of the fused layer are the parts' rows in order (zero points of 12- and 20-row parts
    share packed words, so they are repacked)."""
    parts = _parts(layout, outs)
    fmt = FORMATS["awq" if layout == "awq" else "compressed-tensors"]
    fused = quant_linear(parts, fmt, WeightLayout(4, 32, False), torch.float32)
    want = torch.cat([_dequantized(p, layout) for p in parts])
    assert fused.out_features == sum(outs)
    torch.testing.assert_close(fused.dequantized_weight(), want, rtol=0, atol=0)
    torch.testing.assert_close(fused.bias, torch.cat([p["bias"] for p in parts]))


def test_incomplete_or_mismatched_checkpoints_are_user_errors(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.models.loading import ModelLoadError

    src = tiny_models["llama"]
    sd = load_file(str(src / "model.safetensors"))
    for name, change, message in (
        ("no_up", lambda d: d.pop("model.layers.1.mlp.up_proj.weight"), "no tensors for model.layers.1.mlp.up_proj"),
        ("short_k", lambda d: d.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
         "map 64 → 112 features, the config says 64 → 128"),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_bytes((src / "config.json").read_bytes())
        tensors = dict(sd)
        change(tensors)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=message):
            load_decoder(d, "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_decoder(tmp_path / "nowhere", "cpu")


def test_partial_rotary_turns_only_the_first_channels():
    """partial_rotary_factor 0.5 of a 16-channel head: channels 0-7 rotate as transformers' rotate_half
    over an 8-channel rotary dim, channels 8-15 pass through."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from quantkit.engine.layers import RotaryEmbedding

    config = LlamaConfig(**{**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                                                         "partial_rotary_factor": 0.5}})
    rope = RotaryEmbedding(config, 64)
    assert rope.rotary_dim == 8
    positions = torch.tensor([0, 3, 17, 40])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    q2, k2 = q.clone(), k.clone()
    rope(q2, k2, rope.rows(positions, None))
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, 8, 2).float() / 8)
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q[..., :8], k[..., :8], emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(q2[..., :8], want_q)
    torch.testing.assert_close(k2[..., :8], want_k)
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])


CUDA = torch.device("cuda")  # a device object only: resolve_dtype asks nothing of the GPU but bf16 support
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("config, want", [
    ({"torch_dtype": "bfloat16"}, torch.bfloat16),
    ({"dtype": "bfloat16"}, torch.bfloat16),                            # the key transformers ≥ 4.56 writes
    ({"torch_dtype": "float16"}, torch.float16),
    ({"torch_dtype": "float32"}, torch.bfloat16),                       # fp32's range at half the memory
    ({}, torch.float16),
    ({"torch_dtype": "bfloat16", "quantization_config": AWQ}, torch.float16),  # AWQ kernels and scales: fp16
])
def test_auto_dtype_on_cuda_follows_the_checkpoint(monkeypatch, config, want):
    from quantkit.engine.model import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", config, CUDA) == want
    assert resolve_dtype(None, config, CUDA) == want


def test_an_explicit_dtype_wins_and_the_cpu_keeps_float32(monkeypatch):
    from quantkit.engine.model import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    awq = {"torch_dtype": "float16", "quantization_config": AWQ}
    assert resolve_dtype("bfloat16", awq, CUDA) == torch.bfloat16
    assert resolve_dtype("float16", {"torch_dtype": "bfloat16"}, CUDA) == torch.float16
    assert resolve_dtype(torch.float32, {"torch_dtype": "bfloat16"}, CUDA) == torch.float32
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cpu) == torch.float32
    assert resolve_dtype("bfloat16", {"torch_dtype": "float16"}, cpu) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, CUDA) == torch.float16


def test_the_engine_config_dtype_reaches_the_model(tiny_models):
    from quantkit.engine import Engine, EngineConfig

    for dtype, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        engine = Engine(tiny_models["llama"], EngineConfig(device="cpu", dtype=dtype, num_kv_tokens=256))
        assert engine.model.dtype == want and engine.runner.kv_caches[0].k.dtype == want
