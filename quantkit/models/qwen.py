"""Qwen (v1, `QWenLMHeadModel`): converted to the Qwen2 layout on load, so no remote modeling code is needed.

Qwen v1's block is Qwen2's with other names: `attn.c_attn` is q, k and v stacked by rows (each
heads·kv_channels rows, with a bias), `attn.c_proj` is o_proj (no bias), and its MLP computes
c_proj(w1(x) · silu(w2(x))), so w2 is the gate and w1 the up projection. Its config's
intermediate_size is twice the MLP width. The rotary embedding is the same (rotate-half layout).

Length extrapolation: Qwen's code scales the rotary base by a dynamic NTK alpha (2^⌈log2(L/seq_length)+1⌉ − 1,
computed once from the prompt's length L at prefill and kept while decoding) and multiplies the queries at
positions p ≥ seq_length by log_seq_length(p + 1) (logn attention). The NTK alpha is 1 (a no-op) whenever
the prompt is within seq_length, however long the answer; it is not reproduced for longer prompts (plain
RoPE there: transformers' "dynamic" rope type is another formula, recomputed every step, and a per-sequence
base fixed at prefill does not fit a paged, chunked, prefix-cached prefill). Logn attention is reproduced
by the engine (the config's `logn_attention_length`, see engine/layers.py), not by transformers' Qwen2
class, which ignores that key: past seq_length quantkit.load's model differs from Qwen's and the engine's.

The tokenizer (`qwen.tiktoken`, tiktoken ranks) becomes a fast tokenizer with Qwen's regular expression,
NFC normalization and special tokens, and the ChatML chat template of Qwen's `chat()`. Generation stops at
<|im_end|> and <|endoftext|>. The export is a plain Qwen2ForCausalLM.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from quantkit.config import UserError, read_json
from quantkit.models.llama_family import LLAMA_GROUPS, LLAMA_LINEARS
from quantkit.models.registry import ArchSpec, Conversion, register
from quantkit.models.tiktoken_convert import read_tiktoken_ranks, tiktoken_to_fast

log = logging.getLogger(__name__)

VOCAB_FILE = "qwen.tiktoken"
# Qwen's pre-tokenizer (its tokenization file's PAT_STR): unlike GPT-4's, digits are split one by one.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END] + [f"<|extra_{i}|>" for i in range(205)]
DEFAULT_SYSTEM = "You are a helpful assistant."
# ChatML as Qwen's chat() lays it out (make_context), with its default system message.
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class QwenConversionError(UserError):
    """A Qwen v1 checkpoint with settings the Qwen2 layout cannot express."""


def qwen2_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Qwen (v1) config.json mapping → the equivalent Qwen2Config keyword arguments."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_channels = cfg.get("kv_channels", hidden // heads)
    if kv_channels * heads != hidden:
        raise QwenConversionError(f"Qwen config: kv_channels {kv_channels} × {heads} heads ≠ hidden_size {hidden}; "
                                  "only checkpoints whose heads span the hidden size convert to the Qwen2 layout")
    if float(cfg.get("rotary_pct", 1.0)) != 1.0:
        raise QwenConversionError(f"Qwen config: rotary_pct {cfg['rotary_pct']} (partial rotary) is not supported; "
                                  "every released Qwen v1 model rotates whole heads (rotary_pct 1.0)")
    if not cfg.get("no_bias", True):
        raise QwenConversionError("Qwen config: no_bias false (biases on c_proj and the MLP) is not supported; "
                                  "Qwen2's layout has biases on q/k/v only")
    seq_length = int(cfg.get("seq_length", 2048))
    max_positions = int(cfg.get("max_position_embeddings") or seq_length)
    if max_positions > seq_length and cfg.get("use_dynamic_ntk"):
        log.warning("Qwen: a prompt longer than seq_length %d (up to %d) uses plain RoPE; Qwen's dynamic NTK, "
                    "which its own code applies to such prompts, is not reproduced", seq_length, max_positions)
    logn = {"logn_attention_length": seq_length} if cfg.get("use_logn_attn") else {}
    return {
        **logn,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": cfg["intermediate_size"] // 2,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-6),
        "rope_theta": float(cfg.get("rotary_emb_base", 10000)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "use_sliding_window": False,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
    }


def _qwen2_config(cfg: dict[str, Any]):
    from transformers import Qwen2Config

    return Qwen2Config(**qwen2_config_dict(cfg))


_RENAMES = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"^transformer\.h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^transformer\.h\.(\d+)\.mlp\.w1\.", r"model.layers.\1.mlp.up_proj."),
    (r"^transformer\.h\.(\d+)\.mlp\.w2\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
)
# Buffers some Qwen checkpoints carry: computed, never weights.
_DROPPED = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.masked_bias)$")


def to_qwen2_state_dict(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rename Qwen (v1) tensors to Qwen2 names and split every c_attn (weight and bias) into q, k, v."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if _DROPPED.search(name):
            continue
        m = re.match(r"^transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)$", name)
        if m:
            if tensor.shape[0] % 3:
                raise QwenConversionError(f"{name} has {tensor.shape[0]} rows, not q, k and v of equal size")
            for proj, t in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                out[f"model.layers.{m.group(1)}.self_attn.{proj}.{m.group(2)}"] = t.contiguous()
            continue
        for pattern, repl in _RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = tensor
    return out


def _vocab_file(path: Path) -> Path:
    if not (path / VOCAB_FILE).is_file():
        raise UserError(f"{path}: a Qwen (v1) checkpoint needs its {VOCAB_FILE} (the tokenizer's vocabulary); "
                        "quantkit runs no remote code: add the file of this model")
    return path / VOCAB_FILE


def _vocab_size(path: Path) -> int:
    return len(read_tiktoken_ranks(_vocab_file(path)))


def load_tokenizer(path: Path):
    """Qwen's tokenizer from its qwen.tiktoken, as a fast tokenizer with the ChatML chat template."""
    cfg = read_json(path / "tokenizer_config.json")
    return tiktoken_to_fast(
        _vocab_file(path), PATTERN, SPECIAL_TOKENS, nfc=True, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
        chat_template=cfg.get("chat_template") or CHAT_TEMPLATE, model_max_length=cfg.get("model_max_length"),
    )


def stop_tokens(generation_config, path: Path):
    """Qwen's chat() stops at <|im_end|> (and <|endoftext|>); its generation_config.json names only the latter."""
    endoftext = _vocab_size(path) + SPECIAL_TOKENS.index(ENDOFTEXT)
    im_end = _vocab_size(path) + SPECIAL_TOKENS.index(IM_END)
    generation_config.eos_token_id = [im_end, endoftext]
    if generation_config.pad_token_id is None:
        generation_config.pad_token_id = endoftext
    return generation_config


QWEN = register(
    ArchSpec(
        "qwen",
        ("QWenLMHeadModel",),
        linears=LLAMA_LINEARS,
        groups=LLAMA_GROUPS,
        export_architecture="Qwen2ForCausalLM",
        conversion=Conversion(
            config=_qwen2_config, state_dict=to_qwen2_state_dict, source_layers_path="transformer.h",
            tokenizer=load_tokenizer, generation=stop_tokens,
        ),
        notes="Qwen (v1) converted to the Qwen2 layout on load; exported as Qwen2ForCausalLM",
        qkv_bias=True,
    )
)
