"""DecoderModels of real shapes with random weights, built layer by layer on the device (benchmarks).

A shape is the config.json of the model it stands for. A family that the engine runs converted (Qwen v1
as Qwen2, ChatGLM2 as Glm with its 2 KV groups) goes through its registry entry's conversion, so the
model is the one the engine builds for that family's real checkpoint. The weights come from a reader
that makes each checkpoint tensor (the converted layout's names: the registry entry's linears) when the
loader asks for it, so the model goes through the same loader as a real checkpoint (fusing, QuantLinear)
without a file: fp16 weights, AWQ-gemm 4-bit group-128 codes, zeros and scales ("w4"), or 8-bit
symmetric per-channel compressed-tensors codes and scales, as `quantkit int8` exports them ("w8").
Speed does not depend on their values. InternLM2-1.8B is given in the Llama layout it is converted to.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from quantkit.config import UserError
from quantkit.engine import weights
from quantkit.engine.model import DecoderModel
from quantkit.formats.fp8 import Fp8Layout
from quantkit.formats.layout import WeightLayout
from quantkit.formats.registry import FORMATS
from quantkit.models.registry import spec_for_config

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SHAPES: dict[str, dict] = {
    "llama2-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    "llama3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "internlm2-1.8b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                           num_attention_heads=16, num_key_value_heads=8, vocab_size=92544,
                           max_position_embeddings=32768, rope_theta=1000000.0),
    # THUDM/chatglm2-6b: multi-query attention with 2 KV groups, a bias on q/k/v only.
    "chatglm2-6b": dict(architectures=["ChatGLMModel"], model_type="chatglm", hidden_size=4096, ffn_hidden_size=13696,
                        num_layers=28, num_attention_heads=32, kv_channels=128, multi_query_attention=True,
                        multi_query_group_num=2, padded_vocab_size=65024, seq_length=32768, layernorm_epsilon=1e-5,
                        rmsnorm=True, post_layer_norm=True, add_bias_linear=False, add_qkv_bias=True,
                        apply_residual_connection_post_layernorm=False, tie_word_embeddings=False),
    # Qwen/Qwen-7B-Chat and Qwen-14B-Chat (v1): intermediate_size is twice the MLP width. Their
    # use_dynamic_ntk is left out: it acts on prompts past seq_length only, and the conversion drops it.
    "qwen-7b": dict(architectures=["QWenLMHeadModel"], model_type="qwen", hidden_size=4096, intermediate_size=22016,
                    num_hidden_layers=32, num_attention_heads=32, kv_channels=128, vocab_size=151936,
                    seq_length=8192, max_position_embeddings=8192, rotary_emb_base=10000, rotary_pct=1.0,
                    layer_norm_epsilon=1e-6, no_bias=True, use_logn_attn=True, tie_word_embeddings=False),
    "qwen-14b": dict(architectures=["QWenLMHeadModel"], model_type="qwen", hidden_size=5120, intermediate_size=27392,
                     num_hidden_layers=40, num_attention_heads=40, kv_channels=128, vocab_size=152064,
                     seq_length=2048, max_position_embeddings=8192, rotary_emb_base=10000, rotary_pct=1.0,
                     layer_norm_epsilon=1e-6, no_bias=True, use_logn_attn=True, tie_word_embeddings=False),
    # The CPU smoke shape: group 128 still divides every input dimension.
    "tiny": dict(_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0),
}
GROUP_SIZE = 128
WEIGHTS = ("w4", "w8", "fp8", "fp16")
QUANT = {  # weights kind → the export format and layout its random tensors take
    "w4": (FORMATS["awq"], WeightLayout(4, GROUP_SIZE, symmetric=False)),
    "w8": (FORMATS["compressed-tensors"], WeightLayout(8, -1, symmetric=True)),
    "fp8": (FORMATS["float-quantized"], Fp8Layout()),  # FP8_DYNAMIC: e4m3 per channel, activations per token
}


def config_for(cfg: dict) -> Any:
    """The transformers config the engine runs for a config.json mapping (converted where its family is)."""
    spec = spec_for_config(cfg)
    if spec.conversion is not None:
        return spec.conversion.config(cfg)
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def shape_config(shape: str) -> Any:
    if shape not in SHAPES:
        raise UserError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    return config_for(SHAPES[shape])


def _linear_dims(model: DecoderModel) -> dict[str, tuple[int, int, bool]]:
    """(out, in, bias) of each checkpoint linear of a block, by its name in the registry entry."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden, inter = attn.o_proj.out_features, mlp.down_proj.in_features
    qkv_bias, o_bias = attn.qkv_proj.bias is not None, attn.o_proj.bias is not None
    mlp_bias = mlp.down_proj.bias is not None
    dims = {"q_proj": (attn.q_size, hidden, qkv_bias), "k_proj": (attn.kv_size, hidden, qkv_bias),
            "v_proj": (attn.kv_size, hidden, qkv_bias), "o_proj": (hidden, attn.q_size, o_bias),
            "gate_proj": (inter, hidden, mlp_bias), "up_proj": (inter, hidden, mlp_bias),
            "gate_up_proj": (2 * inter, hidden, mlp_bias), "down_proj": (hidden, inter, mlp_bias)}
    linears = spec_for_config(model.config).linears
    unknown = [n for n in linears if n.rpartition(".")[2] not in dims]
    if unknown:
        raise UserError(f"random weights are not made for {unknown[0]} ({model.family}): use a Llama-like shape")
    return {name: dims[name.rpartition(".")[2]] for name in linears}


class RandomTensors:
    """A checkpoint reader whose tensors are made on `device` when read (seeded per tensor name): those
    of `config`'s model with fp weights, or quantized (`bits` 4: AWQ gemm group 128; 8: per channel;
    `fp8`: e4m3 weights with a scale per channel)."""

    def __init__(self, config, quantized: bool, device: torch.device, dtype: torch.dtype, bits: int = 4,
                 model: Optional[DecoderModel] = None, fp8: bool = False) -> None:
        self.device, self.dtype, self.bits, self.fp8 = device, dtype, bits, fp8
        if model is None:
            with torch.device("meta"):
                model = DecoderModel(config)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.linears: dict[str, tuple[int, int]] = {}  # checkpoint linear → (out, in)
        for name, module in model.named_modules():  # norms and the embedding (q/k norms where the family has them)
            if "layers." in name and not name.startswith("model.layers.0."):
                continue
            if not isinstance(module, nn.Linear):
                for pname, p in module.named_parameters(recurse=False):
                    self.shapes[f"{name}.{pname}"] = tuple(p.shape)
        if not model.tie_word_embeddings:
            self.shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        for name, (out_f, in_f, bias) in _linear_dims(model).items():
            p = "model.layers.0." + name
            self.linears[p] = (out_f, in_f)
            if not quantized or fp8:
                self.shapes[p + ".weight"] = (out_f, in_f)
                if fp8:
                    self.shapes[p + ".weight_scale"] = (out_f, 1)
            elif bits == 4:
                if in_f % GROUP_SIZE:
                    raise UserError(f"{name} has {in_f} inputs, not whole groups of {GROUP_SIZE}: use w8 or fp16")
                self.shapes[p + ".qweight"] = (in_f, out_f // 8)
                self.shapes[p + ".qzeros"] = (in_f // GROUP_SIZE, out_f // 8)
                self.shapes[p + ".scales"] = (in_f // GROUP_SIZE, out_f)
            else:
                self.shapes[p + ".weight_packed"] = (out_f, -(-in_f * bits // 32))
                self.shapes[p + ".weight_scale"] = (out_f, 1)
                self.shapes[p + ".weight_shape"] = (2,)
            if bias:
                self.shapes[p + ".bias"] = (out_f,)
        self._copy_block_0(config.num_hidden_layers)

    def _copy_block_0(self, layers: int) -> None:
        """Every block's tensors named after block 0's (the blocks of a decoder are alike)."""
        for table in (self.shapes, self.linears):
            for name in [n for n in table if n.startswith("model.layers.0.")]:
                for i in range(1, layers):
                    table[f"model.layers.{i}." + name[len("model.layers.0."):]] = table[name]

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, names) -> dict[str, torch.Tensor]:
        return {n: self._make(n) for n in names}

    def _make(self, name: str) -> torch.Tensor:
        shape, dev = self.shapes[name], self.device
        g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
        if name.endswith((".qweight", ".qzeros", ".weight_packed")):
            return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=dev, generator=g)
        if name.endswith(".weight_shape"):
            return torch.tensor(self.linears[name.rpartition(".")[0]], dtype=torch.int64, device=dev)
        # (q − z)·s within ±0.05 (w4: |q − z| ≤ 15; w8: |q − 128| ≤ 128): activations stay finite
        if name.endswith(".scales"):
            return (torch.rand(shape, device=dev, generator=g) * 0.002 + 0.001).to(torch.float16)
        if name.endswith(".weight_scale"):
            if self.fp8:  # e4m3 values of N(0, 50²) times 1–3e-4: weights within ±0.1, σ ≈ 0.01
                return (torch.rand(shape, device=dev, generator=g) * 0.0002 + 0.0001).float()
            return (torch.rand(shape, device=dev, generator=g) * 0.0002 + 0.0001).to(torch.float16)
        if self.fp8 and name.endswith(".weight") and name.rpartition(".")[0] in self.linears:
            return (torch.randn(shape, device=dev, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=dev)
        return (torch.randn(shape, device=dev, generator=g) * 0.02).to(self.dtype)


def random_model(config, weights_kind: str, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The engine's DecoderModel for `config` on `device`, random weights of `weights_kind`: "w4" (AWQ
    gemm, group 128), "w8" (8-bit per channel, compressed-tensors), "fp8" (e4m3 per channel, activations per
    token: compressed-tensors float-quantized) or "fp16" (the model dtype)."""
    if weights_kind not in WEIGHTS:
        raise UserError(f"unknown weights {weights_kind!r}: use one of {', '.join(WEIGHTS)}")
    quant = QUANT.get(weights_kind)
    with torch.device("meta"):
        model = DecoderModel(config)
    reader = RandomTensors(config, quant is not None, device, dtype, 8 if weights_kind == "w8" else 4, model,
                           fp8=weights_kind == "fp8")
    fmt, layout = quant or (None, None)
    ckpt = weights.Checkpoint(Path(f"<random {model.family} {weights_kind}>"), config, reader, format=fmt, layout=layout)
    weights.load_weights(model, ckpt, device, dtype)
    model.model.rotary_emb.to(device)
    return model.eval().requires_grad_(False)


def build_random_model(shape: str, weights_kind: str, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """A DecoderModel of the named shape (SHAPES) on `device`; see `random_model`."""
    return random_model(shape_config(shape), weights_kind, device, dtype)
