"""DecoderModels of real shapes with random weights, built layer by layer on the device (benchmarks).

The weights come from a reader that makes each checkpoint tensor when the loader asks for it, so the
model goes through the same loader as a real checkpoint (fusing, QuantLinear) without a file: fp16
weights, or AWQ-gemm 4-bit group-128 codes, zeros and scales (speed does not depend on their values).
InternLM2-1.8B is given in the Llama layout the loader converts it to.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from quantkit.config import UserError
from quantkit.engine import weights
from quantkit.engine.model import DecoderModel

SHAPES: dict[str, dict] = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "internlm2-1.8b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
                           num_key_value_heads=8, vocab_size=92544, max_position_embeddings=32768,
                           rope_theta=1000000.0),
    # The CPU smoke shape: group 128 still divides every input dimension.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0),
}
GROUP_SIZE = 128
WEIGHTS = ("w4", "fp16")


def shape_config(shape: str):
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise UserError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


class RandomTensors:
    """A checkpoint reader whose tensors are made on `device` when read (seeded per tensor name)."""

    LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, config, quantized: bool, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.quantized, self.device, self.dtype = config, quantized, device, dtype
        c = config
        head_dim = c.hidden_size // c.num_attention_heads
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        self.shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                       "model.norm.weight": (c.hidden_size,), "lm_head.weight": (c.vocab_size, c.hidden_size)}
        linears = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size),
                   "self_attn.v_proj": (kv, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q),
                   "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
                   "mlp.up_proj": (c.intermediate_size, c.hidden_size),
                   "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            self.shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
            self.shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
            for name, (out_f, in_f) in linears.items():
                if quantized:
                    self.shapes[p + name + ".qweight"] = (in_f, out_f // 8)
                    self.shapes[p + name + ".qzeros"] = (in_f // GROUP_SIZE, out_f // 8)
                    self.shapes[p + name + ".scales"] = (in_f // GROUP_SIZE, out_f)
                else:
                    self.shapes[p + name + ".weight"] = (out_f, in_f)

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, names) -> dict[str, torch.Tensor]:
        return {n: self._make(n) for n in names}

    def _make(self, name: str) -> torch.Tensor:
        shape, dev = self.shapes[name], self.device
        g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
        if name.endswith((".qweight", ".qzeros")):
            return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=dev, generator=g)
        if name.endswith(".scales"):  # (q − z)·s within ±0.03: activations stay finite over many layers
            return (torch.rand(shape, device=dev, generator=g) * 0.002 + 0.001).to(torch.float16)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=dev)
        return (torch.randn(shape, device=dev, generator=g) * 0.02).to(self.dtype)


def build_random_model(shape: str, weights_kind: str, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """A DecoderModel of `shape` on `device`: "w4" (AWQ gemm, group 128) or "fp16" (the model dtype)."""
    if weights_kind not in WEIGHTS:
        raise UserError(f"unknown weights {weights_kind!r}: use w4 or fp16")
    config = shape_config(shape)
    quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True, "version": "gemm"}
    ckpt = weights.Checkpoint(Path(f"<random {shape} {weights_kind}>"), config,
                              RandomTensors(config, weights_kind == "w4", device, dtype),
                              quant=quant if weights_kind == "w4" else None)
    with torch.device("meta"):
        model = DecoderModel(config)
    weights.load_weights(model, ckpt, device, dtype)
    model.model.rotary_emb.to(device)
    return model.eval().requires_grad_(False)
