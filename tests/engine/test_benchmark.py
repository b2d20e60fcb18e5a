"""The benchmarks' smoke runs on the CPU (`--tiny`), and the random-weight models they time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from quantkit.engine.benchmark import BenchSetup, latency, throughput
from quantkit.engine.random_model import RandomTensors, build_random_model, shape_config
from quantkit.nn.quant_linear import QuantLinear

ROOT = Path(__file__).resolve().parents[2]


def test_random_w4_model_has_the_shapes_and_packed_layers():
    model = build_random_model("tiny", "w4", torch.device("cpu"), torch.float32)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.group_size == 128
    cfg = shape_config("tiny")
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    assert (attn.qkv_proj.in_features, attn.qkv_proj.out_features) == (cfg.hidden_size, cfg.hidden_size + 2 * kv)
    w = attn.qkv_proj.dequantized_weight()
    assert w.abs().max() < 0.05 and w.std() > 1e-3  # random codes under small scales: finite activations
    # Real shapes are described without building them: Llama-3-8B's GQA projections and vocabulary.
    big = RandomTensors(shape_config("llama3-8b"), True, torch.device("cpu"), torch.float16)
    assert big.shapes["model.layers.0.self_attn.k_proj.qweight"] == (4096, 1024 // 8)
    assert big.shapes["lm_head.weight"] == (128256, 4096)


def test_latency_and_throughput_tiny():
    row = latency(BenchSetup(tiny=True), prompt_len=8, output_len=12, runs=1)
    assert row["shape"] == "tiny" and row["output_len"] == 12 and row["decode_tok_s"] > 0
    row = throughput(BenchSetup(tiny=True, weights="fp16", kv_bits=8), num_prompts=6, input_len=20, output_len=5)
    assert row["output_tok_s"] > 0 and row["num_prompts"] == 6 and row["kv_bits"] == 8


def test_bench_scripts_and_cli_tiny(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "lat.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--tiny", "--num-prompts", "4",
                           "--input-len", "16", "--output-len", "4", "--kv-bits", "16,4", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["kv_bits"] for r in rows] == [16, 4] and all(r["output_tok_s"] > 0 for r in rows)
    from typer.testing import CliRunner

    from quantkit.cli import app

    result = CliRunner().invoke(app, ["bench", "latency", "--tiny", "--input-len", "4", "--output-len", "6", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["decode_tok_s"] > 0
