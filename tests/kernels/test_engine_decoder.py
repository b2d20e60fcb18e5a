"""The engine's decoder on the Triton kernels (fused norm/rope/silu, paged KV write and decode
attention) through the interpreter: the same logits as transformers. Qwen3 has them all at work on
strided q/k/v views, per-head q/k norms and grouped-query heads."""

import torch

from decoder_check import assert_same_logits, hf_model
from quantkit.engine.model import load_decoder


def test_qwen3_on_triton_kernels_matches_transformers(tiny_models, monkeypatch):
    monkeypatch.setenv("QUANTKIT_KERNEL", "triton")
    model, _, _ = load_decoder(tiny_models["qwen3"], "cpu", torch.float32)
    assert_same_logits(model, hf_model(tiny_models["qwen3"]))
