"""The engine's decoder on the Triton kernels (fused norm/rope/silu, paged KV write and decode
attention) through the interpreter: the same logits as transformers. Qwen3 has them all at work on
strided q/k/v views, per-head q/k norms and grouped-query heads."""

import torch

from quantkit_testing.decoder_check import assert_same_logits, hf_model
from quantkit.engine.model import load_decoder
from quantkit.kernels.settings import KernelSettings


TRITON = KernelSettings(path="triton")


def test_qwen3_on_triton_kernels_matches_transformers(tiny_models, triton_interpreter):
    model, _, _ = load_decoder(tiny_models["qwen3"], "cpu", torch.float32)
    assert_same_logits(model, hf_model(tiny_models["qwen3"]), kernels=TRITON)


def test_glm_on_triton_kernels_matches_transformers(tmp_path, triton_interpreter):
    """Glm's rotary (adjacent pairs on half of each head) through the Triton rope kernel, with q/k/v bias."""
    from quantkit_testing.tiny import write_tiny_glm

    src = write_tiny_glm(tmp_path / "glm")
    model, _, _ = load_decoder(src, "cpu", torch.float32)
    assert model.model.rotary_emb.interleaved and model.model.rotary_emb.rotary_dim == 8
    assert_same_logits(model, hf_model(src), kernels=TRITON)
