"""Random-weight models of the converted families (ChatGLM2 as Glm, Qwen v1 as Qwen2), at fp16, w8 and w4:
the linears the engine builds for them, and their logits against transformers' model of the same
(dequantized) tensors; the seed table's script on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from quantkit_testing.decoder_check import assert_same_logits
from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.random_model import SHAPES, RandomTensors, config_for, random_model, shape_config
from quantkit.kernels import reference
from quantkit.nn.quant_linear import QuantLinear

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
# The seed shapes' config.json with small dimensions; every other key (KV groups, biases, logn) kept.
TINY = {
    "chatglm2": dict(SHAPES["chatglm2-6b"], hidden_size=256, ffn_hidden_size=384, num_layers=2, num_attention_heads=4,
                     kv_channels=64, padded_vocab_size=512, seq_length=1024),
    "qwen": dict(SHAPES["qwen-7b"], hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 kv_channels=64, vocab_size=512, seq_length=1024, max_position_embeddings=1024),
}
KV_HEADS = {"chatglm2": 2, "qwen": 4}
FAMILY = {"chatglm2": "glm", "qwen": "qwen2"}
MLP_WIDTH = {"chatglm2": 384, "qwen": 384}  # Qwen's config intermediate_size is twice the MLP width


@pytest.mark.parametrize("weights", ["fp16", "w8", "w4"])
@pytest.mark.parametrize("name", list(TINY))
def test_linears_follow_the_config(name, weights):
    model = random_model(config_for(TINY[name]), weights, CPU, torch.float32)
    assert model.family == FAMILY[name] and model.num_kv_heads == KV_HEADS[name] and model.head_dim == 64
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    dims = {attn.qkv_proj: (256, 4 * 64 + 2 * KV_HEADS[name] * 64), attn.o_proj: (256, 256),
            mlp.gate_up_proj: (256, 2 * MLP_WIDTH[name]), mlp.down_proj: (MLP_WIDTH[name], 256)}
    for layer, (in_f, out_f) in dims.items():
        assert (layer.in_features, layer.out_features) == (in_f, out_f)
        if weights == "fp16":
            assert type(layer) is nn.Linear
        else:  # w8 as `quantkit int8` writes it: symmetric, one scale per output channel
            assert isinstance(layer, QuantLinear)
            want = (4, 128, "awq", False) if weights == "w4" else (8, in_f, "packed", True)
            assert (layer.bits, layer.group_size, layer.layout, layer.symmetric) == want
    # Both families carry a bias on q/k/v only.
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and mlp.down_proj.bias is None
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def _dequantized_state_dict(config, weights: str) -> dict[str, torch.Tensor]:
    """The reader's tensors in transformers' names, each quantized linear dequantized by the reference."""
    reader = RandomTensors(config, weights != "fp16", CPU, torch.float32, 8 if weights == "w8" else 4)
    t = reader.read(reader.names())
    sd = {n: v for n, v in t.items() if not n.endswith((".qweight", ".qzeros", ".scales", ".weight_packed",
                                                        ".weight_scale", ".weight_shape"))}
    for linear, (out_f, in_f) in reader.linears.items():
        if weights == "w4":
            w = reference.dequantize_awq(t[linear + ".qweight"], t[linear + ".qzeros"], t[linear + ".scales"], 128)
        elif weights == "w8":
            w = reference.dequantize_packed(t[linear + ".weight_packed"], t[linear + ".weight_scale"], None,
                                            out_f, in_f, 8, in_f)
        else:
            continue
        sd[linear + ".weight"] = w
    return sd


@pytest.mark.parametrize("weights", ["fp16", "w8", "w4"])
@pytest.mark.parametrize("name", list(TINY))
def test_logits_match_transformers(name, weights):
    """The engine's decoder (prefill and decode over a paged cache) against transformers' Glm / Qwen2."""
    from transformers import AutoModelForCausalLM

    config = config_for(TINY[name])
    model = random_model(config, weights, CPU, torch.float32)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(_dequantized_state_dict(config, weights), strict=True)
    if weights != "fp16":  # random codes under small scales: finite activations over many layers
        w = model.model.layers[0].mlp.down_proj.dequantized_weight()
        assert 5e-3 < w.std() and w.abs().max() < 0.05
    assert_same_logits(model, hf)


def test_engine_greedy_tokens_on_w8_glm():
    """A whole engine (runner, KV pool, sampler) on the int8 model: transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    config = config_for(TINY["chatglm2"])
    engine = Engine.from_model(random_model(config, "w8", CPU, torch.float32), None,
                               EngineConfig(device="cpu", dtype=torch.float32, num_kv_tokens=256, max_num_seqs=1,
                                            max_model_len=64, cuda_graphs=False))
    prompt = list(range(40, 52))
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), progress=False)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(_dequantized_state_dict(config, "w8"))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert got[0].token_ids == want.tolist()


def test_seed_shapes_are_described_without_building():
    glm = RandomTensors(shape_config("chatglm2-6b"), True, CPU, torch.float16, bits=8)
    assert glm.linears["model.layers.27.self_attn.k_proj"] == (2 * 128, 4096)  # 2 KV groups of 128 channels
    assert glm.linears["model.layers.0.mlp.gate_up_proj"] == (2 * 13696, 4096)
    assert glm.shapes["model.layers.0.mlp.down_proj.weight_packed"] == (4096, 13696 // 4)
    qwen = RandomTensors(shape_config("qwen-14b"), True, CPU, torch.float16)
    assert qwen.linears["model.layers.39.mlp.down_proj"] == (5120, 13696)
    assert qwen.shapes["model.layers.0.mlp.down_proj.qzeros"] == (13696 // 128, 5120 // 8)
    assert qwen.shapes["lm_head.weight"] == (152064, 5120)
    assert "model.layers.0.self_attn.q_proj.bias" in qwen.shapes
    assert "model.layers.40.input_layernorm.weight" not in qwen.shapes  # 40 blocks: 0–39


def test_seed_table_script_tiny(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "seed.json"
    proc = subprocess.run([sys.executable, "-m", "bench.latency", "--seed-table", "--tiny", "--input-len", "4",
                           "--output-len", "4", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["weights"] for r in rows] == ["fp16", "w8", "w4"] and all(r["decode_tok_s"] > 0 for r in rows)
    assert "Characters/s is not given" in proc.stdout


def test_fp8_random_model_runs_in_the_engine():
    """`random:SHAPE:fp8`: e4m3 weights with a scale per channel and activations per token (FP8_DYNAMIC),
    small enough that a whole engine decodes finite logits; the benches take it like the other kinds."""
    from quantkit.engine.benchmark import BenchSetup, latency
    from quantkit.nn.fp8_linear import Fp8Linear

    model = random_model(config_for(TINY["qwen"]), "fp8", CPU, torch.float32)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.weight.dtype == torch.float8_e4m3fn and down.activations == "dynamic"
    w = down.dequantized_weight()
    assert 5e-3 < w.std() < 0.05 and w.abs().max() < 0.1
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # the bias stays beside the e4m3 weight
    row = latency(BenchSetup(tiny=True, weights="fp8"), prompt_len=8, output_len=6, runs=1)
    assert row["weights"] == "fp8" and row["decode_tok_s"] > 0
