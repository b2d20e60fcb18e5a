"""The engine's decoder: one module for the registry's Llama-layout families, built from a transformers config.

What differs between the families is data: the registry entry's `extra` (Qwen2 puts a bias on q/k/v,
Qwen3 normalizes q and k per head, Glm rotates adjacent channel pairs and has no o_proj bias) and the
config (`attention_bias`, `mlp_bias`, `partial_rotary_factor`); InternLM2 arrives converted to the Llama
layout (models/internlm2.py), ChatGLM2/3 to the Glm one (models/chatglm.py). q/k/v are one linear
(`qkv_proj`) and gate/up another (`gate_up_proj`); engine/weights.py fuses the checkpoint's separate
tensors into them (Glm's checkpoints hold gate_up_proj already fused).
Module names otherwise follow transformers', so checkpoint names map onto them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from quantkit.config import UserError
from quantkit.engine import weights
from quantkit.engine.attention import Attention, AttnMetadata
from quantkit.engine.layers import RMSNorm, RotaryEmbedding, SiluAndMul, feeds_fp8
from quantkit.formats.registry import FORMATS
from quantkit.models.registry import ArchSpec, spec_for_config

log = logging.getLogger(__name__)

def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or spec.qkv_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # Glm: attention_bias puts a bias on q/k/v only (the registry entry says o_proj has none).
        o_bias = attention_bias if spec.o_proj_bias is None else spec.o_proj_bias
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def project(self, hidden: torch.Tensor, rope_rows: tuple[torch.Tensor, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] of the normalized hidden states, q and k rotated."""
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rotary(q, k, rope_rows)
        return q, k, v


class DecoderMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UserError(f"activation {act!r} is not supported by the engine (SiLU-gated MLPs only); "
                            "use quantkit.load for this model")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config)

    # A layer is `begin`, attention, `end`: the model runner's piecewise CUDA graphs (engine/piecewise.py)
    # replay `end` of one layer and `begin` of the next as one graph and run attention between them.
    def begin(self, hidden, residual, rope_rows):
        """(q, k, v, residual) from the previous layer's output and the residual stream (None: the first)."""
        # The residual stream is added inside the norms (one fused op each) rather than after each sub-block.
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(hidden, rope_rows), residual)

    def end(self, attn_out, residual):
        """(output, residual) from attention's output [T, heads, D] and the residual stream."""
        attn = self.self_attn
        hidden = attn.o_proj(attn_out.reshape(-1, attn.q_size))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def link_fp8_inputs(self) -> None:
        """The norms and SiLU·mul quantize for the FP8 linears they feed (layers.feeds_fp8)."""
        feeds_fp8(self.input_layernorm, self.self_attn.qkv_proj)
        feeds_fp8(self.post_attention_layernorm, self.mlp.gate_up_proj)
        feeds_fp8(self.mlp.act, self.mlp.down_proj)

    def forward(self, hidden, residual, rope_rows, meta: AttnMetadata):
        q, k, v, residual = self.begin(hidden, residual, rope_rows)
        return self.end(self.self_attn.attn(q, k, v, meta), residual)


class Decoder(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        with torch.device("cpu"):  # a computed table, never a checkpoint tensor (the model may be built on meta)
            self.rotary_emb = RotaryEmbedding(config, max_positions, spec.rope_interleaved)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, self.rotary_emb) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                input_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        seq_lens = meta.token_seq_lens() if self.rotary_emb.dynamic else None
        rope_rows = self.rotary_emb.rows(positions, seq_lens)
        if input_embeds is None:
            hidden = self.embed_tokens(input_ids)
        else:  # (rows [R], embeddings [R, hidden]) in place of those tokens' (an image's features)
            rows, values = input_embeds
            hidden = self.embed_tokens(input_ids.index_fill(0, rows, 0))  # a placeholder id may lie past the vocabulary
            hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope_rows, meta)
        return self.norm(hidden, residual)[0]


class DecoderModel(nn.Module):
    """forward(input_ids [T], positions [T], meta) → hidden [T, hidden] for the step described by the
    attention metadata `meta` (`input_embeds` = (rows, embeddings) replaces the embeddings of those rows'
    tokens: an image's features at its placeholder tokens); compute_logits(hidden [N, hidden]) → float32
    [N, vocab]."""

    def __init__(self, config: Any, max_positions: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        spec = spec_for_config(config)
        self.family = spec.name
        self.max_positions = max_positions or config.max_position_embeddings
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            log.warning("the config sets a sliding window of %s tokens; the engine attends over the whole "
                        "context, which differs beyond that length", config.sliding_window)
        self.model = Decoder(config, spec, self.max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.num_layers = config.num_hidden_layers
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                input_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, input_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_kv_caches(self, caches: list) -> None:
        if len(caches) != self.num_layers:
            raise ValueError(f"{len(caches)} KV caches for {self.num_layers} layers")
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.attn.kv_cache = cache

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device


def resolve_dtype(requested: Any, config: dict, device: torch.device) -> torch.dtype:
    """The dtype of activations and unquantized weights: `requested` (EngineConfig.dtype: a torch dtype,
    "float16", "bfloat16", or "auto"/None) for a checkpoint whose config.json is `config`, on `device`.

    auto on the CPU is float32 (what the CPU's reference paths run fastest and most exactly). On CUDA:
    float16 for an AWQ export (its kernels were tuned and its scales stored in fp16), else the
    checkpoint's torch_dtype: bfloat16 stays bfloat16 (fp16 can overflow on a bf16-trained model),
    float32 becomes bfloat16 (the same exponent range at half the memory), float16 or unset is float16.
    bfloat16 falls back to float16 on a GPU without it."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested not in (None, "auto"):
        return getattr(torch, requested)  # EngineConfig accepted the name
    if device.type != "cuda":
        return torch.float32
    fmt = FORMATS.get((config.get("quantization_config") or {}).get("quant_method"))
    if fmt is not None and fmt.fp16_activations:
        return torch.float16
    saved = str(config.get("torch_dtype") or config.get("dtype") or "float16").removeprefix("torch.")
    if saved not in ("bfloat16", "float32"):
        return torch.float16
    if not torch.cuda.is_bf16_supported():
        log.warning("the checkpoint is %s but this GPU has no bfloat16: running in float16, which can "
                    "overflow where bfloat16 would not", saved)
        return torch.float16
    return torch.bfloat16


def load_decoder(path: str | Path, device: Optional[str | torch.device] = None,
                 dtype: Any = None) -> tuple[DecoderModel, Any, Any]:
    """(model, tokenizer, generation_config) for an fp16/bf16/fp32 HF directory (InternLM2 converted)
    or a quantkit export (AWQ gemm, compressed-tensors W4/W8).

    `device` defaults to CUDA when present; `dtype` (activations and unquantized weights; a torch dtype,
    "float16", "bfloat16" or "auto") is resolved by `resolve_dtype`, None as auto."""
    from quantkit.config import check_device
    from quantkit.engine.kv_scales import set_key_centers
    from quantkit.models.loading import load_tokenizer, read_config_json

    check_device(None if device is None else str(device))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt = weights.open_checkpoint(Path(path))
    dtype = resolve_dtype(dtype, read_config_json(ckpt.directory), device)
    log.info("dtype %s on %s", str(dtype).removeprefix("torch."), device)
    with torch.device("meta"):
        model = DecoderModel(ckpt.config)
    weights.load_weights(model, ckpt, device, dtype)
    model.model.rotary_emb.to(device)
    set_key_centers(model, ckpt.directory)  # what KV4 pools subtract from keys, from the checkpoint's KV statistics
    model.eval().requires_grad_(False)
    tokenizer = load_tokenizer(ckpt.directory, spec=ckpt.spec)
    return model, tokenizer, weights.generation_config(ckpt)
