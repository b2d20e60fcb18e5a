"""Baichuan2-7B (`BaichuanForCausalLM`) and Baichuan-7B (`BaiChuanForCausalLM`): converted to the Llama
layout on load, so no remote modeling code is needed.

Their block is Llama's but for `self_attn.W_pack`, q, k and v stacked by rows (hidden_size rows each, no
bias). Baichuan2's `lm_head` is a NormHead: in eval mode its forward replaces the weight by its rows
divided by their L2 norm (F.normalize) and multiplies by that, so the conversion writes the normalized
rows into a plain lm_head (Baichuan-7B's lm_head is a plain linear and is kept).

The 13B models (Baichuan-13B, Baichuan2-13B; hidden size 5120, a config with model_max_length and no
max_position_embeddings) use ALiBi instead of rotary embeddings: a per-head linear bias −slope_h·(i − j)
on the attention scores. Neither the Llama layout (transformers' LlamaForCausalLM, used to calibrate
and to export) nor the engine's attention (the prefill SDPA and the paged decode kernels) adds such a
bias, so they are refused with a one-line error.

The tokenizer is the checkpoint's sentencepiece model, converted without its remote code
(models/tokenizer_convert.py). Baichuan's chat() marks turns with reserved tokens whose ids its
generation_config.json gives (user_token_id 195, assistant_token_id 196 in Baichuan2: the pieces
<reserved_106> and <reserved_107>); the converted tokenizer holds those pieces as special tokens and a
chat template that writes them as build_chat_input does: the system text, then per message the role's
token and the content, then the assistant token. The export is a plain LlamaForCausalLM.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.config import UserError, read_json
from quantkit.models.llama_family import LLAMA_GROUPS, LLAMA_LINEARS
from quantkit.models.registry import ArchSpec, Conversion, register, split_fused_qkv
from quantkit.models.tokenizer_convert import sentencepiece_to_fast

BAICHUAN2 = "BaichuanForCausalLM"  # Baichuan2-7B/13B and Baichuan-13B
BAICHUAN1_7B = "BaiChuanForCausalLM"
# Baichuan2's generation_config.json values, the defaults when a checkpoint's lacks them.
USER_TOKEN_ID, ASSISTANT_TOKEN_ID = 195, 196


class BaichuanConversionError(UserError):
    """A Baichuan checkpoint the Llama layout cannot run."""


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or [BAICHUAN2]
    return archs[0]


def uses_alibi(cfg: dict[str, Any]) -> bool:
    """The 13B models: ALiBi attention (their config names model_max_length, not max_position_embeddings)."""
    return cfg.get("hidden_size") == 5120 or "max_position_embeddings" not in cfg


def llama_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Baichuan (7B) config.json mapping → the equivalent LlamaConfig keyword arguments."""
    if uses_alibi(cfg):
        raise BaichuanConversionError(
            "Baichuan 13B is not supported: it uses ALiBi attention (a per-head linear position bias), which "
            "neither transformers' Llama layout nor the engine's attention kernels apply; Baichuan2-7B (rotary) is")
    heads = cfg["num_attention_heads"]
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": 10000.0,  # fixed in Baichuan's RotaryEmbedding
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": cfg.get("bos_token_id", 1),
        "eos_token_id": cfg.get("eos_token_id", 2),
        "pad_token_id": cfg.get("pad_token_id", 0),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }


def _llama_config(cfg: dict[str, Any]):
    from transformers import LlamaConfig

    return LlamaConfig(**llama_config_dict(cfg))


_W_PACK = re.compile(r"^(.*)\.self_attn\.W_pack\.(weight)$")


def to_llama_state_dict(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Split every W_pack into q/k/v; Baichuan2's NormHead lm_head becomes its row-normalized weight."""
    def split(name: str, tensor: torch.Tensor) -> tuple:
        if tensor.shape[0] != 3 * cfg["hidden_size"]:
            raise BaichuanConversionError(f"{name} has {tensor.shape[0]} rows, not 3 × hidden_size")
        return tuple(t.contiguous() for t in tensor.chunk(3, dim=0))

    out = split_fused_qkv(sd, _W_PACK, split, skip=(".rotary_emb.inv_freq",))
    if "lm_head.weight" in out and _architecture(cfg) == BAICHUAN2:
        out["lm_head.weight"] = F.normalize(out["lm_head.weight"].float(), dim=-1)  # NormHead's eval-mode weight
    return out


def chat_template(user: str, assistant: str) -> str:
    """build_chat_input's layout as a chat template: system text, role token + content per message, then
    the assistant token (no separators, no BOS: Baichuan's tokenizer adds none)."""
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}{{- '" + user + "' + message['content'] -}}"
        "{%- elif message['role'] == 'assistant' -%}{{- '" + assistant + "' + message['content'] -}}"
        "{%- else -%}{{- message['content'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '" + assistant + "' -}}{%- endif -%}"
    )


def role_tokens(path: Path) -> tuple[int, int] | None:
    """(user_token_id, assistant_token_id) of a chat checkpoint's generation_config.json, else None."""
    gen = read_json(path / "generation_config.json")
    if "user_token_id" not in gen and "assistant_token_id" not in gen:
        return None
    return int(gen.get("user_token_id", USER_TOKEN_ID)), int(gen.get("assistant_token_id", ASSISTANT_TOKEN_ID))


def load_tokenizer(path: Path):
    """The sentencepiece tokenizer with the role tokens as special tokens and Baichuan's chat template."""
    import sentencepiece as spm

    model_file = path / "tokenizer.model"
    if not model_file.is_file():
        raise UserError(f"{path}: a Baichuan checkpoint needs its tokenizer.model (sentencepiece); quantkit runs "
                        "no remote code: add the tokenizer.model of this model")
    cfg = read_json(path / "tokenizer_config.json")
    roles = role_tokens(path)
    if roles is not None:
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        if max(roles) >= sp.get_piece_size():
            raise UserError(f"{path}: generation_config.json's role token ids {roles} are outside the "
                            f"{sp.get_piece_size()}-piece vocabulary of tokenizer.model")
        pieces = [sp.id_to_piece(i) for i in roles]
        added = dict(cfg.get("added_tokens_decoder") or {})
        for i, piece in zip(roles, pieces):
            added.setdefault(str(i), {"content": piece, "special": True, "normalized": False})
        cfg["added_tokens_decoder"] = added
        if not cfg.get("chat_template"):
            cfg["chat_template"] = chat_template(*pieces)
    return sentencepiece_to_fast(model_file, cfg)


def stop_tokens(generation_config, path: Path):
    """Generation also stops where the model opens a new user turn (its user token), as FastChat does."""
    roles = role_tokens(path)
    if roles is None:
        return generation_config
    eos = generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if roles[0] not in eos:
        generation_config.eos_token_id = eos + [roles[0]]
    return generation_config


_CONVERSION = Conversion(config=_llama_config, state_dict=to_llama_state_dict, tokenizer=load_tokenizer,
                         generation=stop_tokens)
BAICHUAN = register(
    ArchSpec(
        "baichuan",
        (BAICHUAN2, BAICHUAN1_7B),
        linears=LLAMA_LINEARS,
        groups=LLAMA_GROUPS,
        export_architecture="LlamaForCausalLM",
        conversion=_CONVERSION,
        notes="Baichuan2-7B / Baichuan-7B converted to the Llama layout on load (W_pack split, NormHead "
              "normalized); the 13B models (ALiBi) are refused; exported as LlamaForCausalLM",
    )
)
