"""InternLM2: converted to the Llama layout on load, so no remote modeling code is needed.

wqkv's rows form num_kv_heads groups, each [q_0 … q_{g−1}, k, v] of head_dim rows (g = heads / kv_heads).
Its AWQ groups are the safe ones: attention_norm → wqkv, ffn_norm → w1,w3, w3 → w2 (after conversion
these are the Llama names). The export is a plain LlamaForCausalLM.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from quantkit.models.llama_family import LLAMA_LINEARS
from quantkit.models.registry import ArchSpec, Conversion, ScaleGroup, register, split_fused_qkv

INTERNLM2 = register(
    ArchSpec(
        "internlm2",
        ("InternLM2ForCausalLM",),
        linears=LLAMA_LINEARS,
        groups=(
            ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
            ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
            ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ),
        export_architecture="LlamaForCausalLM",
        conversion=Conversion(config=lambda cfg: _llama_config(cfg), state_dict=lambda sd, cfg: to_llama_state_dict(sd, cfg)),
        notes="converted to the Llama layout on load; exported as LlamaForCausalLM",
    )
)

_WQKV = re.compile(r"^(.*)\.attention\.wqkv\.(weight|bias)$")
_RENAMES = (
    (r"^model\.tok_embeddings\.", "model.embed_tokens."),
    (r"^output\.", "lm_head."),
    (r"\.attention\.wo\.", ".self_attn.o_proj."),
    (r"\.feed_forward\.w1\.", ".mlp.gate_proj."),
    (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
    (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
)


def llama_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """An InternLM2 config.json mapping → the equivalent LlamaConfig keyword arguments."""
    heads = cfg["num_attention_heads"]
    out = {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        "attention_bias": bool(cfg.get("bias", False)),
        "bos_token_id": cfg.get("bos_token_id", 1),
        "eos_token_id": cfg.get("eos_token_id", 2),
        "pad_token_id": cfg.get("pad_token_id", 0),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }
    if cfg.get("rope_scaling"):
        out["rope_scaling"] = cfg["rope_scaling"]
    return out


def _llama_config(cfg: dict[str, Any]):
    from transformers import LlamaConfig

    return LlamaConfig(**llama_config_dict(cfg))


def split_wqkv(wqkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wqkv [(heads + 2·kv_heads)·head_dim, …] → q, k, v in the Llama row order."""
    g = heads // kv_heads
    head_dim = wqkv.shape[0] // (heads + 2 * kv_heads)
    rest = wqkv.shape[1:]
    grouped = wqkv.reshape(kv_heads, g + 2, head_dim, *rest)
    q = grouped[:, :g].reshape(heads * head_dim, *rest)
    k = grouped[:, g].reshape(kv_heads * head_dim, *rest)
    v = grouped[:, g + 1].reshape(kv_heads * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def to_llama_state_dict(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rename InternLM2 tensors to Llama names and split every wqkv (weight and bias)."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    return split_fused_qkv(sd, _WQKV, lambda _, t: split_wqkv(t, heads, kv_heads), _RENAMES)
