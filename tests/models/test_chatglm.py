"""ChatGLM2/3 without remote code: a checkpoint in ChatGLM's own layout (config.json keys as chatglm3-6b
ships them, scaled down; query_key_value / dense_h_to_4h tensors; tokenizer.model + a tokenizer_config
whose auto_map names Python files that raise if run) loads as transformers' GlmForCausalLM and in the
engine with the logits of a reference forward written from the published modeling_chatglm.py, encodes
as tokenization_chatglm.py does, and quantizes → exports → reloads → generates."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from quantkit_testing.decoder_check import engine_step
from quantkit_testing.tiny import make_sentencepiece_tokenizer

import quantkit
from quantkit import build_config
from quantkit.config import UserError
from quantkit.kernels.paged_kv import PagedKV
from quantkit.models.chatglm import (
    chatglm_tokenizer,
    chatglm_version,
    glm_config_dict,
    split_query_key_value,
    to_glm_state_dict,
)
from quantkit.models.loading import load_fp_model
from quantkit_testing.in_memory import awq_quantize

# chatglm3-6b's config.json as published (its keys and values), before scaling down.
CHATGLM3_6B = {
    "_name_or_path": "THUDM/chatglm3-6b", "model_type": "chatglm", "architectures": ["ChatGLMModel"],
    "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                 "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
                 "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification"},
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True, "ffn_hidden_size": 13696, "fp32_residual_connection": False, "hidden_dropout": 0.0,
    "hidden_size": 4096, "kv_channels": 128, "layernorm_epsilon": 1e-05, "multi_query_attention": True,
    "multi_query_group_num": 2, "num_attention_heads": 32, "num_layers": 28, "original_rope": True,
    "padded_vocab_size": 65024, "post_layer_norm": True, "rmsnorm": True, "seq_length": 8192, "use_cache": True,
    "torch_dtype": "float16", "transformers_version": "4.30.2", "tie_word_embeddings": False,
    "eos_token_id": 2, "pad_token_id": 0,
}
# Scaled down; rope_ratio as chatglm3-6b-32k sets it (base 10000 · 50), so the base scaling is exercised.
TINY_CHATGLM3 = {**CHATGLM3_6B, "_name_or_path": "THUDM/chatglm3-6b-32k", "ffn_hidden_size": 96, "hidden_size": 64,
                 "kv_channels": 16, "num_attention_heads": 4, "num_layers": 2, "padded_vocab_size": 416,
                 "seq_length": 256, "rope_ratio": 50, "torch_dtype": "float32"}
PUBLISHED_TEMPLATE = (  # chatglm3-6b's tokenizer_config.json chat_template (a string quantkit does not use)
    "{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n {{ message['content'] }}"
    "{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REMOTE_CODE = 'raise RuntimeError("remote code executed")\n'
SPECIALS = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
NORMALIZER = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}  # newlines and spaces kept


def chatglm_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under ChatGLM's names and shapes."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_channels"]
    groups, ffn, vocab = cfg["multi_query_group_num"], cfg["ffn_hidden_size"], cfg["padded_vocab_size"]

    def normal(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return torch.rand(n, generator=g) + 0.5

    sd = {"transformer.embedding.word_embeddings.weight": normal(vocab, hidden, std=0.5),
          "transformer.rotary_pos_emb.inv_freq": 1.0 / 10000 ** (torch.arange(0, hd // 2, 2).float() / (hd // 2))}
    for i in range(cfg["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "self_attention.query_key_value.weight": normal((heads + 2 * groups) * hd, hidden),
            p + "self_attention.query_key_value.bias": normal((heads + 2 * groups) * hd, std=0.2),
            p + "self_attention.dense.weight": normal(hidden, heads * hd),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "mlp.dense_h_to_4h.weight": normal(2 * ffn, hidden),
            p + "mlp.dense_4h_to_h.weight": normal(hidden, ffn),
        })
    sd["transformer.encoder.final_layernorm.weight"] = norm(hidden)
    sd["transformer.output_layer.weight"] = normal(vocab, hidden)
    return sd


def reference_forward(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor, linear_rope: bool = False) -> torch.Tensor:
    """Logits [b, s, vocab] as modeling_chatglm.py computes them (ChatGLM2/3, fp32, no cache)."""
    b, s = ids.shape
    heads, hd, groups = cfg["num_attention_heads"], cfg["kv_channels"], cfg["multi_query_group_num"]
    eps, ratio = cfg["layernorm_epsilon"], cfg.get("rope_ratio", 1)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    # RotaryEmbedding(rotary_dim // 2): n_elem = head_dim / 2 channels turn, cache [s, n_elem / 2, (cos, sin)].
    n_elem = hd // 2
    base = 10000 if linear_rope else 10000 * ratio  # ChatGLM2-32K divides positions; ChatGLM3 scales the base
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float) / n_elem))
    seq_idx = torch.arange(s, dtype=torch.float) / (ratio if linear_rope else 1)
    idx_theta = torch.outer(seq_idx, theta).float()
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)

    def rope(x):  # x [b, np, s, hn]: (x[2i], x[2i+1]) pairs on the first n_elem channels
        rot, x_pass = x[..., :n_elem], x[..., n_elem:]
        xs = rot.reshape(b, x.shape[1], s, n_elem // 2, 2)
        c = cache.view(1, 1, s, n_elem // 2, 2)
        out = torch.stack([xs[..., 0] * c[..., 0] - xs[..., 1] * c[..., 1],
                           xs[..., 1] * c[..., 0] + xs[..., 0] * c[..., 1]], -1).flatten(3)
        return torch.cat((out, x_pass), dim=-1)

    h = sd["transformer.embedding.word_embeddings.weight"][ids]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        mixed = x @ sd[p + "self_attention.query_key_value.weight"].T + sd[p + "self_attention.query_key_value.bias"]
        q, k, v = mixed.split([heads * hd, groups * hd, groups * hd], dim=-1)
        q = rope(q.view(b, s, heads, hd).transpose(1, 2))
        k = rope(k.view(b, s, groups, hd).transpose(1, 2))
        v = v.view(b, s, groups, hd).transpose(1, 2)
        # multi-query groups: key_layer.unsqueeze(2).expand(…, heads // groups, …) → head h reads group h // (heads/groups)
        k = k.unsqueeze(2).expand(b, groups, heads // groups, s, hd).reshape(b, heads, s, hd)
        v = v.unsqueeze(2).expand(b, groups, heads // groups, s, hd).reshape(b, heads, s, hd)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, heads * hd)
        h = h + ctx @ sd[p + "self_attention.dense.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        gate_up = x @ sd[p + "mlp.dense_h_to_4h.weight"].T
        a, u = torch.chunk(gate_up, 2, dim=-1)  # swiglu: silu(x[0]) * x[1]
        h = h + (torch.nn.functional.silu(a) * u) @ sd[p + "mlp.dense_4h_to_h.weight"].T
    h = rms(h, sd["transformer.encoder.final_layernorm.weight"])
    return h @ sd["transformer.output_layer.weight"].T


def write_release(directory: Path, cfg: dict, sd: dict[str, torch.Tensor], sp_dir: Path) -> Path:
    """A checkpoint laid out as chatglm3-6b ships: sharded safetensors, config with auto_map, tokenizer.model,
    tokenizer_config naming tokenization_chatglm.py, and Python files that fail if anything runs them."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(sd)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: sd[n].contiguous() for n in part}, str(directory / f"model-0000{i + 1}-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(sp_dir / "tokenizer.model", directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]},
        "tokenizer_class": "ChatGLMTokenizer", "chat_template": PUBLISHED_TEMPLATE, "padding_side": "left",
        "remove_space": False, "do_lower_case": False, "clean_up_tokenization_spaces": False,
    }, indent=2))
    for name in ("modeling_chatglm.py", "tokenization_chatglm.py", "configuration_chatglm.py", "quantization.py"):
        (directory / name).write_text(REMOTE_CODE)
    return directory


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(checkpoint dir, its ChatGLM tensors, sentencepiece processor)."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("chatglm")
    make_sentencepiece_tokenizer(root / "sp", **NORMALIZER)
    sp = spm.SentencePieceProcessor(model_file=str(root / "sp" / "tokenizer.model"))
    assert sp.get_piece_size() + len(SPECIALS) <= TINY_CHATGLM3["padded_vocab_size"]
    sd = chatglm_tensors(TINY_CHATGLM3)
    return write_release(root / "chatglm3-6b-32k", TINY_CHATGLM3, sd, root / "sp"), sd, sp


def special_ids(sp) -> dict[str, int]:
    """tokenization_chatglm.py's SPTokenizer: the special tokens follow the sentencepiece pieces."""
    return {t: sp.get_piece_size() + i for i, t in enumerate(SPECIALS)}


def prefill_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The engine decoder's logits for whole sequences, prefilled together over a fresh paged KV cache."""
    blocks = sum(math.ceil(len(t) / 16) for t in seqs)
    tables = torch.arange(blocks, dtype=torch.int32).view(len(seqs), -1)
    model.set_kv_caches([PagedKV.allocate(blocks, 16, model.num_kv_heads, model.head_dim, 16, model.dtype, "cpu")
                         for _ in range(model.num_layers)])
    with torch.no_grad():
        return engine_step(model, tables, seqs, [0] * len(seqs), decode=False)


def reference_chat_input(sp, history: list[dict], query: str, role: str = "user") -> list[int]:
    """ChatGLM3's build_chat_input (with build_single_message and the [gMASK] sop prefix)."""
    ids = special_ids(sp)

    def single(role, metadata, message):
        return [ids[f"<|{role}|>"]] + sp.encode(f"{metadata}\n") + sp.encode(message)

    out = []
    for item in history:
        content = item["content"]
        if item["role"] == "system" and "tools" in item:
            content = content + "\n" + json.dumps(item["tools"], indent=4, ensure_ascii=False)
        out += single(item["role"], item.get("metadata", ""), content)
    out += single(role, "", query) + [ids["<|assistant|>"]]
    return [ids["[gMASK]"], ids["sop"]] + out


# --- conversion units ------------------------------------------------------------------------------

def test_split_query_key_value_rows():
    heads, groups, hd, hidden = 4, 2, 3, 5
    rows = torch.arange((heads + 2 * groups) * hd, dtype=torch.float32)[:, None].expand(-1, hidden)
    q, k, v = split_query_key_value(rows, heads, groups, multi_query=True)
    assert q[:, 0].tolist() == list(range(heads * hd))
    assert k[:, 0].tolist() == list(range(heads * hd, (heads + groups) * hd))
    assert v[:, 0].tolist() == list(range((heads + groups) * hd, (heads + 2 * groups) * hd))
    # Without multi_query_attention the rows go per head: [q_h; k_h; v_h].
    per_head = torch.arange(3 * heads * hd, dtype=torch.float32)
    q, k, v = split_query_key_value(per_head, heads, heads, multi_query=False)
    assert q.tolist() == [3 * hd * h + r for h in range(heads) for r in range(hd)]
    assert k.tolist() == [3 * hd * h + hd + r for h in range(heads) for r in range(hd)]
    assert v.tolist() == [3 * hd * h + 2 * hd + r for h in range(heads) for r in range(hd)]


def test_config_as_published_maps_to_glm():
    glm = glm_config_dict(CHATGLM3_6B)
    assert (glm["vocab_size"], glm["intermediate_size"], glm["num_hidden_layers"]) == (65024, 13696, 28)
    assert (glm["num_attention_heads"], glm["num_key_value_heads"], glm["head_dim"]) == (32, 2, 128)
    assert glm["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert glm["rms_norm_eps"] == 1e-5 and glm["attention_bias"] and glm["max_position_embeddings"] == 8192
    # chatglm3-6b-32k: base × rope_ratio; chatglm2-6b-32k: positions ÷ rope_ratio (linear).
    assert glm_config_dict({**CHATGLM3_6B, "rope_ratio": 50})["rope_parameters"]["rope_theta"] == 500000.0
    v2 = glm_config_dict({**CHATGLM3_6B, "_name_or_path": "THUDM/chatglm2-6b-32k", "rope_ratio": 16})
    assert v2["rope_parameters"] == {"rope_type": "linear", "factor": 16.0, "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5}
    for bad, match in (({"position_encoding_2d": True, "padded_vocab_size": None}, "first ChatGLM-6B"),
                       ({"pre_seq_len": 128}, "P-tuning"), ({"quantization_bit": 4}, "already quantized"),
                       ({"rmsnorm": False}, "rmsnorm=False"), ({"add_bias_linear": True}, "add_bias_linear=True")):
        cfg = {k: v for k, v in {**CHATGLM3_6B, **bad}.items() if v is not None}
        with pytest.raises(UserError, match=match):
            glm_config_dict(cfg)


def test_version_from_the_checkpoint_files(tmp_path):
    assert chatglm_version({"_name_or_path": "THUDM/chatglm2-6b"}) == 2
    assert chatglm_version({"_name_or_path": "THUDM/chatglm3-6b"}) == 3
    d = tmp_path / "chatglm2-6b" / "snapshots" / "0123abc"
    d.mkdir(parents=True)
    assert chatglm_version({}, d) == 2  # a hub cache path names the model above the snapshot
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": PUBLISHED_TEMPLATE}))
    assert chatglm_version({}, d) == 3  # a template with role tokens wins


def test_state_dict_names(release):
    _, sd, _ = release
    out = to_glm_state_dict(sd, TINY_CHATGLM3)
    assert not [n for n in out if n.startswith("transformer.") or "inv_freq" in n]
    assert out["model.layers.1.mlp.gate_up_proj.weight"] is sd["transformer.encoder.layers.1.mlp.dense_h_to_4h.weight"]
    assert out["model.layers.0.self_attn.k_proj.bias"].shape == (2 * 16,)
    assert len(out) == len(sd) - 1 + 4 * TINY_CHATGLM3["num_layers"]  # inv_freq dropped; qkv w, b → 3 each


# --- logits --------------------------------------------------------------------------------------

def test_logits_match_reference_forward(release):
    """transformers' GlmForCausalLM (the converted load) and the engine's decoder, prefill and decode
    steps over the paged KV cache, against the reference forward of the ChatGLM layout."""
    from quantkit.engine.model import load_decoder

    src, sd, _ = release
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_CHATGLM3["padded_vocab_size"], (2, 24), generator=g)
    with torch.no_grad():
        want = reference_forward(sd, TINY_CHATGLM3, ids)
        loaded = load_fp_model(src, dtype=torch.float32)
        assert type(loaded.model).__name__ == "GlmForCausalLM" and loaded.spec.name == "chatglm"
        got = loaded.model(ids).logits
        assert ((got - want).abs().max() / want.abs().max()) <= 1e-4

        model, _, gen = load_decoder(src, "cpu", torch.float32)
        assert model.model.rotary_emb.interleaved and model.model.rotary_emb.rotary_dim == 8
        assert model.model.layers[0].self_attn.o_proj.bias is None
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        # Two sequences packed: 20 prompt tokens each prefilled, then 4 decode steps one token at a time.
        block, prompt = 16, 20
        tables = torch.arange(4, dtype=torch.int32).view(2, 2)
        model.set_kv_caches([PagedKV.allocate(4, block, model.num_kv_heads, model.head_dim, 16, model.dtype, "cpu")
                             for _ in range(model.num_layers)])
        steps = [engine_step(model, tables, [ids[0, :prompt], ids[1, :prompt]], [0, 0], decode=False)]
        for t in range(prompt, ids.shape[1]):
            steps.append(engine_step(model, tables, [ids[0, t:t + 1], ids[1, t:t + 1]], [t, t], decode=True))
    for b in range(2):
        engine = torch.cat([step[b] for step in steps])
        assert ((engine - want[b]).abs().max() / want[b].abs().max()) <= 1e-4, b
    ratio_ids = special_ids(release[2])
    assert gen.eos_token_id == [2, ratio_ids["<|user|>"], ratio_ids["<|observation|>"]]


def test_chatglm2_32k_interpolates_positions(release, tmp_path):
    """ChatGLM2-6B-32K's rope_ratio divides the positions (its code, not its config, says so: the name does)."""
    src, sd, _ = release
    cfg = {**TINY_CHATGLM3, "_name_or_path": "THUDM/chatglm2-6b-32k", "rope_ratio": 4}
    d = tmp_path / "chatglm2-6b-32k"
    d.mkdir()
    for f in src.iterdir():
        if f.suffix in (".safetensors", ".model"):
            (d / f.name).symlink_to(f)
    (d / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = load_fp_model(d, dtype=torch.float32).model(ids).logits
        want = reference_forward(sd, cfg, ids, linear_rope=True)
        assert ((got - want).abs().max() / want.abs().max()) <= 1e-4
        scaled_base = reference_forward(sd, cfg, ids, linear_rope=False)
        assert ((got - scaled_base).abs().max() / want.abs().max()) > 1e-2  # the two readings differ here


# --- tokenizer -----------------------------------------------------------------------------------

def test_tokenizer_encodes_as_chatglm(release):
    src, _, sp = release
    tok = chatglm_tokenizer(src)
    ids = special_ids(sp)
    rng = random.Random(3)
    zh = "上海是中国最大的城市之一我们今天去公园散步模型把权重量化成整数"
    alphabet = list(zh + "the cache keeps keys, values.:_=0123456789Aesop") + [" ", "  ", "\n", "\t", "😀", "é"]
    texts = ["", "Aesop isopropyl sop eop", "  two  spaces  ", "\n\nnewlines\n", "上海是 the 缓存 😀"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50))) for _ in range(200)]
    for text in texts:
        # ChatGLMTokenizer: [gMASK] sop, then sentencepiece over the whole text (its own "sop" stays text).
        assert tok(text)["input_ids"] == [ids["[gMASK]"], ids["sop"]] + sp.encode(text), repr(text)
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(text)), repr(text)
    assert [tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|observation|>", "</s>")] == \
        [ids["<|user|>"], ids["<|observation|>"], 2]

    tools = [{"name": "track", "description": "追踪股票", "parameters": {"type": "object", "symbol": "str"}}]
    history = [
        {"role": "system", "content": "You are ChatGLM3. 回答要简短。", "tools": tools},
        {"role": "user", "content": "上海是哪个国家的城市？"},
        {"role": "assistant", "metadata": "track", "content": " ```python\ntool_call(symbol='10111')\n```"},
        {"role": "observation", "content": '{"price": 12412}'},
        {"role": "assistant", "content": "The price is 12412.\n\n  Done."},
    ]
    for hist, query in ((history, "Aesop, sop and eop: explain"), ([], "hi"), (history[1:2], "")):
        messages = hist + [{"role": "user", "content": query}]
        got = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        got = got if isinstance(got, list) else got["input_ids"]
        assert got == reference_chat_input(sp, hist, query), query
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok(text, add_special_tokens=False)["input_ids"] == got
    # An answer decoded as generated (empty metadata line, then the text) is kept as chat() keeps it.
    raw = tok.decode([ids["<|assistant|>"]] + sp.encode("\n") + sp.encode("Hello there. "), skip_special_tokens=True)
    assert raw.startswith("\n")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": raw}, {"role": "user", "content": "x"}]
    got = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    got = got if isinstance(got, list) else got["input_ids"]
    assert got == reference_chat_input(sp, [turns[0], {"role": "assistant", "content": "Hello there."}], "x")


def test_chatglm2_prompt_format(release, tmp_path):
    src, _, sp = release
    d = tmp_path / "chatglm2-6b"
    shutil.copytree(src, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": [
        "tokenization_chatglm.ChatGLMTokenizer", None]}}))
    cfg = {**TINY_CHATGLM3, "_name_or_path": "THUDM/chatglm2-6b"}
    cfg.pop("rope_ratio")
    (d / "config.json").write_text(json.dumps(cfg))
    tok = chatglm_tokenizer(d)
    assert "<|user|>" not in tok.get_vocab()  # ChatGLM2's SPTokenizer has no role tokens
    messages = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "上海是哪个国家的城市？"}]
    prompt = "[Round 1]\n\n问：你好\n\n答：Hello!\n\n[Round 2]\n\n问：上海是哪个国家的城市？\n\n答："  # build_prompt
    n = sp.get_piece_size()
    got = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert (got if isinstance(got, list) else got["input_ids"]) == [n + 1, n + 3] + sp.encode(prompt)
    loaded = load_fp_model(d, dtype=torch.float32)
    assert loaded.model.generation_config.eos_token_id == 2  # ChatGLM2 stops at </s> only


def test_glm4_tiktoken_tokenizer_is_refused(release, tmp_path):
    src, _, _ = release
    d = shutil.copytree(src, tmp_path / "glm-4-9b-chat")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ChatGLM4Tokenizer", "auto_map": {
        "AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}}))
    with pytest.raises(UserError, match="GLM-4's tiktoken tokenizer"):
        load_fp_model(d)


# --- quantize → export → reload → generate --------------------------------------------------------

@pytest.fixture(scope="module")
def exports(release, text_file, tmp_path_factory):
    """method → (the loaded model after quantization, its export dir), made once each."""
    import transformers

    made = {}

    def make(method: str, fmt: str):
        if method not in made:
            def no_auto_tokenizer(*args, **kwargs):
                raise AssertionError("AutoTokenizer.from_pretrained on a checkpoint with remote tokenizer code")

            original = transformers.AutoTokenizer.from_pretrained
            transformers.AutoTokenizer.from_pretrained = no_auto_tokenizer
            try:
                loaded = load_fp_model(release[0])
                settings = {"weight.group_size": 32, "calib.samples": 8, "calib.seqlen": 32}
                if method == "awq":
                    settings.update({"awq.n_grid": 8, "awq.search_tokens": 64, "calib.batch_size": 4})
                res = quantkit.quantize(loaded, build_config(method=method, format=fmt, **settings),
                                        calib=str(text_file), work_dir=tmp_path_factory.mktemp(method), progress=False)
            finally:
                transformers.AutoTokenizer.from_pretrained = original
            made[method] = loaded, res.work_dir
        return made[method]

    return make


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("awq", "awq")])
def test_quantize_export_reload_generate(release, exports, method, fmt):
    from quantkit.engine import Engine, EngineConfig, SamplingParams
    from quantkit.engine.llm_engine import encode_chat
    from quantkit.engine.model import load_decoder

    _, sd, sp = release
    ids = special_ids(sp)
    loaded, export = exports(method, fmt)
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["GlmForCausalLM"] and cfg["model_type"] == "glm" and "auto_map" not in cfg
    assert cfg["quantization_config"]["quant_method"] == fmt
    assert not list(export.rglob("*.py"))
    assert "auto_map" not in json.loads((export / "tokenizer_config.json").read_text())
    eos = [2, ids["<|user|>"], ids["<|observation|>"]]
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == eos
    if method == "awq":
        groups = [g["prev"] for g in json.loads((export / "quant_report.json").read_text())["awq"]["blocks"][0]["groups"]]
        assert groups == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.gate_up_proj"]

    # transformers' own GlmForCausalLM (quantkit.load: the export's config through AutoModelForCausalLM).
    x = torch.randint(0, 416, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hf, hf_tok = quantkit.load(export, device="cpu", dtype=torch.float32)
        assert type(hf).__module__ == "transformers.models.glm.modeling_glm"
        got = hf(x).logits
        want = torch.nn.Module.float(loaded.model)(x).logits  # the in-memory model, its weights quantized
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        ref = reference_forward(sd, TINY_CHATGLM3, x)  # W4 g32 moves the logits of random weights ~10 %
        assert (got - ref).norm() / ref.norm() < 0.3
        model, _, _ = load_decoder(export, "cpu", torch.float32)
        tables = torch.arange(2, dtype=torch.int32).view(2, 1)
        model.set_kv_caches([PagedKV.allocate(2, 16, model.num_kv_heads, model.head_dim, 16, model.dtype, "cpu")
                             for _ in range(model.num_layers)])
        engine_out = engine_step(model, tables, [x[0], x[1]], [0, 0], decode=False)
    for b in range(2):
        assert (engine_out[b] - got[b]).abs().max() / got[b].abs().max() <= 1e-4

    # Greedy: the engine on the export = transformers' generate on the export, from a ChatGLM3 chat prompt.
    messages = [{"role": "system", "content": "You are ChatGLM3."}, {"role": "user", "content": "上海是 the cache"}]
    eng = Engine(export, EngineConfig(device="cpu", num_kv_tokens=512))
    prompt = encode_chat(eng.tokenizer, messages)
    assert prompt == encode_chat(hf_tok, messages) == reference_chat_input(sp, messages[:1], messages[1]["content"])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = eng.generate([prompt], params, progress=False)[0]
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert list(out.token_ids) == hf_out[0, len(prompt):].tolist()


def test_export_pipeline_and_chat_without_remote_code(release, exports, monkeypatch):
    """The export's tokenizer and config load with plain transformers (no .py file to run, offline); the
    pipeline answers a chat message and stops at the end-of-turn tokens; `quantkit chat`'s loop answers
    two turns and exits."""
    import io

    from transformers import AutoConfig, AutoTokenizer

    from quantkit import pipeline
    from quantkit.engine import SamplingParams
    from quantkit.engine.chat import run_chat

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, _, sp = release
    _, export = exports("rtn", "compressed-tensors")
    tok = AutoTokenizer.from_pretrained(export)
    assert type(AutoConfig.from_pretrained(export)).__name__ == "GlmConfig"
    ids = tok.apply_chat_template([{"role": "user", "content": "上海是"}], add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert ids == reference_chat_input(sp, [], "上海是")
    assert tok("上海是 the cache")["input_ids"] == [ids[0], ids[1]] + sp.encode("上海是 the cache")  # [gMASK] sop
    pipe = pipeline(export, device="cpu", num_kv_tokens=512)
    assert pipe.engine.generation_config.eos_token_id == [2] + [special_ids(sp)[t] for t in ("<|user|>", "<|observation|>")]
    r = pipe([{"role": "user", "content": "上海是"}], max_tokens=6, temperature=0.0, progress=False)[0]
    assert r.prompt_tokens == len(ids) and 1 <= r.generated_tokens <= 6
    out = io.StringIO()
    run_chat(pipe.engine, SamplingParams(max_tokens=4, temperature=0.0), system="Be brief.",
             stdin=io.StringIO("hello\nmore\nexit\n"), stdout=out)
    assert out.getvalue().count(">>> ") == 3  # two answers, then the prompt that read "exit"
    assert not [m for m in sys.modules if m.startswith(("transformers_modules", "modeling_chatglm",
                                                         "tokenization_chatglm", "configuration_chatglm"))]


def test_cli_int8_then_engine(release, tmp_path):
    """`quantkit int8` on the ChatGLM checkpoint writes a W8 GlmForCausalLM export the engine runs with the
    converted model's logits (int8 per channel: close)."""
    from typer.testing import CliRunner

    from quantkit.cli import app
    from quantkit.engine.model import load_decoder

    src, sd, _ = release
    result = CliRunner().invoke(app, ["int8", str(src), "--work-dir", str(tmp_path / "w8"), "--quiet"])
    assert result.exit_code == 0, result.output
    qc = json.loads((tmp_path / "w8" / "config.json").read_text())["quantization_config"]
    assert next(iter(qc["config_groups"].values()))["weights"]["num_bits"] == 8
    x = torch.randint(0, 416, (1, 12), generator=torch.Generator().manual_seed(5))
    got = prefill_logits(load_decoder(tmp_path / "w8", "cpu", torch.float32)[0], [x[0]])[0]
    with torch.no_grad():
        want = reference_forward(sd, TINY_CHATGLM3, x)[0]
    assert (got - want).norm() / want.norm() < 0.02


# --- plain GlmForCausalLM (transformers' layout, e.g. glm-4-9b-chat-hf) ------------------------------

def test_plain_glm_checkpoint_engine_and_awq(text_file, tmp_path):
    """The 'glm' registry entry: the engine matches transformers' GlmForCausalLM step by step; without
    grouped-query heads AWQ's v→o group scales o_proj's inputs on equal shapes; the export reloads."""
    from quantkit_testing.decoder_check import assert_same_logits, hf_model
    from quantkit_testing.tiny import write_tiny_glm

    from quantkit.engine.model import load_decoder

    src = write_tiny_glm(tmp_path / "glm", num_key_value_heads=4)
    model, _, _ = load_decoder(src, "cpu", torch.float32)
    assert model.family == "glm" and model.model.rotary_emb.interleaved
    assert_same_logits(model, hf_model(src))
    loaded = load_fp_model(src)
    config = build_config(method="awq", **{"weight.group_size": 32, "awq.n_grid": 8, "awq.search_tokens": 64,
                                            "calib.batch_size": 4, "calib.samples": 8, "calib.seqlen": 32})
    res = quantkit.quantize(loaded, config, calib=str(text_file), work_dir=tmp_path / "q", progress=False)
    groups = json.loads((res.work_dir / "quant_report.json").read_text())["awq"]["blocks"][0]["groups"]
    assert [g["prev"] for g in groups] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm",
                                           "mlp.gate_up_proj"]
    assert "tied_heads" not in groups[1] and not (groups[1]["fallback"] or "").startswith("shapes")  # v, o agree
    x = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hf, _ = quantkit.load(res.work_dir, device="cpu", dtype=torch.float32)
        got = hf(x).logits
        torch.testing.assert_close(got, torch.nn.Module.float(loaded.model)(x).logits, rtol=2e-3, atol=2e-3)
    engine_out = prefill_logits(load_decoder(res.work_dir, "cpu", torch.float32)[0], [x[0], x[1]])
    for b in range(2):
        assert (engine_out[b] - got[b]).abs().max() / got[b].abs().max() <= 1e-4


def test_awq_folds_keep_the_glm_function(monkeypatch):
    """With quantization switched off, every searched scale folds without changing the logits: the
    gate_up → down group divides only the up half of gate_up_proj's rows (dividing gate would not cancel)."""
    from quantkit_testing.tiny import TINY
    from transformers import GlmConfig, GlmForCausalLM

    from quantkit.models.registry import spec_for_config
    from quantkit.quantize import awq as awq_mod
    from quantkit.quantize.folding import fold_scales

    torch.manual_seed(0)
    model = GlmForCausalLM(GlmConfig(**TINY, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.08)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    # The fold alone, random scales: the MLP's output stays.
    mlp, x = model.model.layers[0].mlp, torch.randn(3, 64)
    with torch.no_grad():
        ref, s = mlp(x), torch.rand(128) + 0.5
        gate = mlp.gate_up_proj.weight[:128].clone()
        fold_scales(mlp.gate_up_proj, [mlp.down_proj], s, s, slice(128, 256))
        assert torch.equal(mlp.gate_up_proj.weight[:128], gate)
        torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)
        fold_scales(mlp.gate_up_proj, [mlp.down_proj], 1 / s, 1 / s, slice(128, 256))
    monkeypatch.setattr(awq_mod, "finalize_block", lambda *a, **k: ({}, {}))
    config = build_config(method="awq", **{"weight.group_size": 32, "awq.n_grid": 8, "awq.search_tokens": 64,
                                            "calib.batch_size": 4, "awq.propagate": "fp"})
    report: dict = {}
    windows = torch.randint(3, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    awq_quantize(model, spec_for_config(model.config), config, windows, report, progress=False)
    folded = [(g["prev"], g.get("ratio")) for b in report["awq"]["blocks"] for g in b["groups"] if not g["fallback"]]
    assert any(prev == "mlp.gate_up_proj" and ratio for prev, ratio in folded), report["awq"]["fallbacks"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)
