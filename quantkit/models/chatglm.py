"""ChatGLM2-6B / ChatGLM3-6B without remote code: converted to transformers' Glm layout on load.

ChatGLM2/3 (`ChatGLMModel` / `ChatGLMForConditionalGeneration`, model_type "chatglm") is the block
transformers' `GlmForCausalLM` (model_type "glm") describes, under other names:

    transformer.embedding.word_embeddings          → model.embed_tokens
    …encoder.layers.N.input_layernorm             → model.layers.N.input_layernorm      (RMSNorm)
    …self_attention.query_key_value (w, bias)      → self_attn.q_proj / k_proj / v_proj (split)
    …self_attention.dense (no bias)                → self_attn.o_proj                   (no bias)
    …post_attention_layernorm                      → post_attention_layernorm
    …mlp.dense_h_to_4h ([gate; up], swiglu)        → mlp.gate_up_proj (same tensor: silu(first half) · second half)
    …mlp.dense_4h_to_h                             → mlp.down_proj
    transformer.encoder.final_layernorm            → model.norm
    transformer.output_layer                       → lm_head
    transformer.rotary_pos_emb.inv_freq            → dropped (the table is recomputed)

query_key_value's rows are [all q heads; the multi_query_group_num k heads; the v heads] (with
multi_query_attention; without it, per head [q_h; k_h; v_h]); query head h reads kv group
h // (heads / groups), which is transformers' repeat_kv. The rotary embedding turns the first half of
each head's channels (head_dim / 2) in adjacent pairs (2i, 2i + 1), frequency i of base 10000 ·
rope_ratio: Glm's partial_rotary_factor 0.5 with its interleaved rotate_half. ChatGLM2-6B-32K's
rope_ratio divides the positions instead (linear scaling); which one a checkpoint means is read from
its name (see `chatglm_version`). The export is a plain GlmForCausalLM, which transformers and vLLM load.

The tokenizer (sentencepiece `tokenizer.model` + tokenization_chatglm.py) is converted to a fast
tokenizer: the special tokens that the Python code appends after the sentencepiece vocabulary
([MASK], [gMASK], [sMASK], sop, eop and, for ChatGLM3, <|system|>, <|user|>, <|assistant|>,
<|observation|>) get the same ids; plain text is encoded as `[gMASK] sop` + sentencepiece; the chat
template writes what ChatGLM3's `build_chat_input` (or ChatGLM2's "[Round N]" prompt) builds. `sop`
and `eop` are named `<sop>` / `<eop>` in the converted vocabulary, so that a word such as "Aesop" in a
user's text is not cut at a special token (ids unchanged).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from quantkit.config import UserError
from quantkit.models.registry import ArchSpec, Conversion, ScaleGroup, register, split_fused_qkv

log = logging.getLogger(__name__)

GLM_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_up_proj", "mlp.down_proj",
)
# down_proj reads silu(gate) · up: its input scales fold into the up half of gate_up_proj's rows only
# (prev_part (1, 2)), never into gate, whose rows pass through the SiLU.
GLM_GROUPS = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", needs_equal_shapes=True),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", prev_part=(1, 2)),
)
# What the engine's decoder builds beyond the Llama block: rotary pairs (2i, 2i + 1) on the first
# partial_rotary_factor of each head, and no o_proj bias whatever attention_bias says.
GLM_EXTRA = {"rope_interleaved": True, "o_proj_bias": False}  # GLM and ChatGLM (in GLM's layout)

GLM = register(
    ArchSpec("glm", ("GlmForCausalLM",), linears=GLM_LINEARS, groups=GLM_GROUPS, **GLM_EXTRA,
             notes="q/k/v carry a bias (o_proj none); gate/up are one linear; rotary on half of each head, "
                   "in adjacent pairs")
)

# Appended after the sentencepiece vocabulary by tokenization_chatglm.py, in this order.
SPECIAL_TOKENS = ("[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>")
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

# ChatGLM3's build_chat_input: per message <|role|> + encode(metadata + "\n") + encode(content), after
# [gMASK] sop; a system message's tools are appended as JSON. Text between special tokens is encoded on
# its own with the dummy prefix, so "\n " + content gives encode("\n") + encode(content). An answer as
# the model wrote it ("\n" after an empty metadata line) goes back into the history as its chat code
# keeps it (process_response: the content after the first newline, stripped).
CHATGLM3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first %}[gMASK]<sop>{% endif %}"
    "{% set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('ChatGLM3 has no role ' + role) }}{% endif %}"
    "{% set content = message['content'] or '' %}"
    "{% if role == 'assistant' and content.startswith('\n') %}{% set content = content[1:].strip() %}{% endif %}"
    "{% if role == 'system' and message['tools'] is defined and message['tools'] %}"
    "{% set content = content + '\\n' + (message['tools'] | tojson(indent=4)) %}{% endif %}"
    "<|{{ role }}|>{{ message['metadata'] or '' if message['metadata'] is defined else '' }}\n"
    "{% if content %} {{ content }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# ChatGLM2's build_prompt: "[Round i]\n\n问：{query}\n\n答：{response}\n\n" per turn, encoded whole after
# [gMASK] sop. ChatGLM2 has no system role: a system message's text goes first, then a blank line.
CHATGLM2_TEMPLATE = (
    "[gMASK]<sop>"
    "{% set ns = namespace(round=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}{% set ns.round = ns.round + 1 %}"
    "[Round {{ ns.round }}]\n\n问：{{ message['content'] }}\n\n答："
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}\n\n"
    "{% else %}{{ raise_exception('ChatGLM2 has no role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
)


def _chatglm_config_checks(cfg: dict[str, Any]) -> None:
    if "padded_vocab_size" not in cfg or cfg.get("position_encoding_2d") is not None:
        raise UserError("this ChatGLM checkpoint is the first ChatGLM-6B (2D positions, GELU, LayerNorm); quantkit "
                        "converts ChatGLM2-6B and ChatGLM3-6B only")
    unsupported = {
        "rmsnorm": (False, "LayerNorm instead of RMSNorm"),
        "post_layer_norm": (False, "no final norm"),
        "apply_residual_connection_post_layernorm": (True, "the residual taken after the norm"),
        "add_bias_linear": (True, "biases on the dense / MLP linears"),
    }
    for key, (bad, what) in unsupported.items():
        if bool(cfg.get(key, not bad)) == bad:
            raise UserError(f"this ChatGLM checkpoint sets {key}={bad} ({what}); the Glm layout it is converted to "
                            "has no such option")
    if cfg.get("pre_seq_len"):
        raise UserError("this ChatGLM checkpoint carries a P-tuning v2 prefix encoder (pre_seq_len); merge or drop "
                        "it first: quantkit converts the plain model only")
    if cfg.get("quantization_bit"):
        raise UserError(f"this ChatGLM checkpoint is already quantized by its own code (quantization_bit="
                        f"{cfg['quantization_bit']}); quantize the full-precision release")


def chatglm_version(cfg: dict[str, Any], path: Path | None = None) -> int:
    """2 or 3: which ChatGLM a checkpoint is, from its files (the two share model_type and layout).

    ChatGLM3 is recognised by a tokenizer_config.json that names its role tokens (chat_template, added
    tokens) or by a name ("chatglm3" in config.json's _name_or_path or in the directory's path); ChatGLM2
    (and CodeGeeX2, its code model) by its name. A checkpoint with neither counts as ChatGLM3."""
    texts = [str(cfg.get("_name_or_path", ""))]
    if path is not None:
        tok_cfg = path / "tokenizer_config.json"
        if tok_cfg.is_file():
            try:
                tc = json.loads(tok_cfg.read_text())
            except json.JSONDecodeError:
                tc = {}
            if any(role in json.dumps(tc.get(key, ""), ensure_ascii=False) for role in ROLE_TOKENS
                   for key in ("chat_template", "added_tokens_decoder", "additional_special_tokens")):
                return 3
            texts.append(str(tc.get("name_or_path", "")))
        texts.append(str(path.resolve()))
    for text in texts:
        low = text.lower()
        if "chatglm3" in low:
            return 3
        if "chatglm2" in low or "codegeex2" in low:
            return 2
    return 3


def glm_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """A ChatGLM2/3 config.json mapping → the equivalent GlmConfig keyword arguments."""
    _chatglm_config_checks(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("kv_channels") or cfg["hidden_size"] // heads
    kv_heads = cfg["multi_query_group_num"] if cfg.get("multi_query_attention", False) else heads
    ratio = float(cfg.get("rope_ratio", 1) or 1)
    rope = {"rope_type": "default", "rope_theta": 10000.0 * ratio, "partial_rotary_factor": 0.5}
    if ratio != 1 and chatglm_version(cfg) == 2:
        # ChatGLM2-6B-32K divides the positions by rope_ratio (position interpolation), base 10000.
        rope = {"rope_type": "linear", "factor": ratio, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return {
        "vocab_size": cfg["padded_vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg.get("num_layers", cfg.get("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.get("seq_length", 8192),
        "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        "rope_parameters": rope,
        "attention_bias": bool(cfg.get("add_qkv_bias", True)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": None,
        "eos_token_id": cfg.get("eos_token_id", 2),
        "pad_token_id": cfg.get("pad_token_id", 0),
        "architectures": ["GlmForCausalLM"],
    }


def glm_config(cfg: dict[str, Any]):
    from transformers import GlmConfig

    return GlmConfig(**glm_config_dict(cfg))


def split_query_key_value(qkv: torch.Tensor, heads: int, kv_heads: int, multi_query: bool = True):
    """query_key_value rows (weight or bias) → q, k, v in transformers' row order."""
    rest = qkv.shape[1:]
    if multi_query:
        head_dim = qkv.shape[0] // (heads + 2 * kv_heads)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
    else:  # per head [q_h; k_h; v_h]
        per_head = qkv.reshape(heads, 3, qkv.shape[0] // (3 * heads), *rest)
        q, k, v = (per_head[:, i].reshape(-1, *rest) for i in range(3))
    return q.contiguous(), k.contiguous(), v.contiguous()


_RENAMES = (
    (r"^transformer\.embedding\.word_embeddings\.", "model.embed_tokens."),
    (r"^transformer\.encoder\.final_layernorm\.", "model.norm."),
    (r"^transformer\.output_layer\.", "lm_head."),
    (r"^transformer\.encoder\.layers\.", "model.layers."),
    (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.gate_up_proj."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
)
_QKV = re.compile(r"^(transformer\.encoder\.layers\.\d+)\.self_attention\.query_key_value\.(weight|bias)$")


def to_glm_state_dict(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rename ChatGLM tensors to Glm names, split every query_key_value, drop the rotary table."""
    heads = cfg["num_attention_heads"]
    multi_query = bool(cfg.get("multi_query_attention", False))
    kv_heads = cfg["multi_query_group_num"] if multi_query else heads
    return split_fused_qkv(sd, _QKV, lambda _, t: split_query_key_value(t, heads, kv_heads, multi_query),
                           _RENAMES, skip=("rotary_pos_emb.inv_freq",))


# --- tokenizer ------------------------------------------------------------------------------------

def _special_tokens(version: int) -> tuple[str, ...]:
    return SPECIAL_TOKENS + (ROLE_TOKENS if version == 3 else ())


def _piece_count(model_file: Path) -> int:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise UserError("converting ChatGLM's tokenizer needs sentencepiece: pip install sentencepiece protobuf") from None
    try:
        return SentencePieceProcessor(model_file=str(model_file)).get_piece_size()
    except (RuntimeError, OSError) as exc:
        raise UserError(f"{model_file} is not a sentencepiece model ({str(exc).splitlines()[0]}); quantkit converts "
                        "ChatGLM2/3's sentencepiece tokenizer (GLM-4's tiktoken one is not: use the -hf release)") from None


def _tokenizer_model(path: Path) -> Path:
    model_file = path / "tokenizer.model"
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file() and "ChatGLM4Tokenizer" in tok_cfg.read_text():
        raise UserError(f"{path}: GLM-4's tiktoken tokenizer (ChatGLM4Tokenizer) is not converted; use the "
                        "transformers release of the model (glm-4-9b-chat-hf, a GlmForCausalLM) instead")
    if not model_file.is_file():
        raise UserError(f"{path}: ChatGLM's tokenizer is remote code and this checkpoint has no tokenizer.model to "
                        "convert; quantkit runs no remote code: add the sentencepiece tokenizer.model of this model")
    return model_file


def special_token_ids(path: Path, version: int | None = None) -> dict[str, int]:
    """The ids tokenization_chatglm.py gives its special tokens: after the sentencepiece pieces, in order."""
    if version is None:
        cfg_file = path / "config.json"
        version = chatglm_version(json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}, path)
    n = _piece_count(_tokenizer_model(path))
    return {t: n + i for i, t in enumerate(_special_tokens(version))}


def chatglm_tokenizer(path: Path):
    """ChatGLM2/3's tokenizer as a fast tokenizer, built from tokenizer.model (no remote code run)."""
    from tokenizers import processors

    from quantkit.models.tokenizer_convert import sentencepiece_to_fast

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    version = chatglm_version(cfg, path)
    ids = special_token_ids(path, version)
    token = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": False, "special": True}
    tokenizer_config = {
        "added_tokens_decoder": {str(i): {"content": t, **token} for t, i in ids.items()},
        "bos_token": None, "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False, "padding_side": "left",
        "chat_template": CHATGLM3_TEMPLATE if version == 3 else CHATGLM2_TEMPLATE,
    }
    try:
        tok = sentencepiece_to_fast(path / "tokenizer.model", tokenizer_config)
    except Exception as exc:  # a protobuf DecodeError: not a sentencepiece model at all
        if isinstance(exc, UserError):
            raise
        raise UserError(f"{path / 'tokenizer.model'} cannot be read as a sentencepiece model: {exc}") from None
    # build_inputs_with_special_tokens: [gMASK] sop before the text (a pair: A B </s>).
    prefix = [("[gMASK]", ids["[gMASK]"]), ("<sop>", ids["<sop>"])]
    eos = ("</s>", tok.convert_tokens_to_ids("</s>"))
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A $B </s>", special_tokens=prefix + [eos])
    return tok


def chatglm_generation(gen: Any, path: Path) -> Any:
    """ChatGLM3's chat code stops at <|user|> and <|observation|> besides </s>; its files do not say so."""
    ids = special_token_ids(Path(path))
    eos = gen.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    for t in ("<|user|>", "<|observation|>"):
        if t in ids and ids[t] not in eos:
            eos.append(ids[t])
    gen.eos_token_id = eos if len(eos) > 1 else (eos[0] if eos else None)
    if gen.pad_token_id is None:
        gen.pad_token_id = 0
    return gen


CHATGLM = register(
    ArchSpec(
        "chatglm",
        ("ChatGLMModel", "ChatGLMForConditionalGeneration"),
        linears=GLM_LINEARS,
        groups=GLM_GROUPS,
        **GLM_EXTRA,
        export_architecture="GlmForCausalLM",
        conversion=Conversion(
            config=lambda cfg: glm_config(cfg),
            state_dict=lambda sd, cfg: to_glm_state_dict(sd, cfg),
            source_layers_path="transformer.encoder.layers",
            tokenizer=lambda path: chatglm_tokenizer(path),
            generation=lambda gen, path: chatglm_generation(gen, path),
        ),
        notes="ChatGLM2/3 converted to the Glm layout on load; exported as GlmForCausalLM",
    )
)
