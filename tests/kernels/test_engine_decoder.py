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


def test_fp8_export_on_triton_kernels_matches_quantkit_load(tiny_models, tmp_path, triton_interpreter):
    """An FP8 W8A8 export (Qwen2: q/k/v bias in the product's epilogue) on the FP8 kernels — the quantizing
    RMSNorm and SiLU·mul, the quantize kernel in front of o_proj, the swap-AB product — against
    quantkit.load's layers on the torch reference."""
    import quantkit
    from quantkit.config import build_config
    from quantkit.engine.layers import SiluAndMul
    from quantkit.kernels.fp8 import Fp8Activations

    config = build_config(method="fp8", fp8={"scheme": "dynamic", "weight_strategy": "channel"})
    out = quantkit.quantize(str(tiny_models["qwen2"]), config, work_dir=tmp_path / "fp8", progress=False).work_dir
    model, _, _ = load_decoder(out, "cpu", torch.float32)
    layer = model.model.layers[0]
    assert layer.input_layernorm.fp8_input_of is layer.self_attn.qkv_proj
    assert isinstance(layer.mlp.act, SiluAndMul) and layer.mlp.act.fp8_input_of is layer.mlp.down_proj
    assert "fp8_input_of" not in dict(layer.named_modules())  # linked, not a second copy in the module tree
    layer.mlp.act.kernels = TRITON
    assert isinstance(layer.mlp.act(torch.randn(2, 2 * layer.mlp.down_proj.in_features)), Fp8Activations)
    hf, _ = quantkit.load(out, device="cpu")
    assert_same_logits(model, hf, kernels=TRITON)
