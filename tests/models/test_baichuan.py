"""Baichuan2-7B without remote code: a checkpoint laid out as BaichuanForCausalLM ships it (W_pack, NormHead
lm_head, pytorch_model.bin, config.json / tokenizer_config.json / generation_config.json as published,
scaled down) loads as Llama with the logits of a reference forward written here from Baichuan2's published
modeling code; its sentencepiece tokenizer and chat format (user/assistant role tokens) are converted; it
quantizes, exports (LlamaForCausalLM), reloads and generates. The 13B models (ALiBi) are refused."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quantkit_testing.decoder_check import engine_logits, make_prompts
from quantkit_testing.tiny import make_sentencepiece_tokenizer

import quantkit
from quantkit.cli import main as cli_main
from quantkit.config import UserError, build_config
from quantkit.engine.model import load_decoder
from quantkit.models import baichuan
from quantkit.models.loading import load_fp_model

REMOTE_CODE = 'raise RuntimeError("remote code executed")\n'
REMOTE_FILES = ("modeling_baichuan.py", "configuration_baichuan.py", "tokenization_baichuan.py", "generation_utils.py")
ROLE_PIECES = ["<reserved_106>", "<reserved_107>"]
# Baichuan2-7B-Chat's config.json, scaled down.
CONFIG = {
    "_from_model_config": True, "architectures": ["BaichuanForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                 "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
    "tokenizer_class": "BaichuanTokenizer", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 256,
    "model_max_length": 256, "model_type": "baichuan", "num_attention_heads": 4, "num_hidden_layers": 2,
    "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.29.2", "use_cache": True, "vocab_size": None, "z_loss_weight": 0,
}


def special(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": True}


TOKENIZER_CONFIG = {
    "add_bos_token": False, "add_eos_token": False,
    "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]},
    "bos_token": special("<s>"), "clean_up_tokenization_spaces": False, "eos_token": special("</s>"),
    "model_max_length": 4096, "pad_token": special("<unk>"), "sp_model_kwargs": {},
    "tokenizer_class": "BaichuanTokenizer", "unk_token": special("<unk>"), "use_fast": False,
}


def baichuan_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, ff, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return torch.rand(h, generator=g) + 0.5

    # NormHead rows of very different norms: a conversion that forgot to normalize them would show.
    head = w(v, h) * (torch.rand(v, 1, generator=g) * 4 + 0.25)
    sd = {"model.embed_tokens.weight": w(v, h, std=0.5), "model.norm.weight": norm(), "lm_head.weight": head}
    hd = h // cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.W_pack.weight": w(3 * h, h, std=0.15), p + "self_attn.o_proj.weight": w(h, h),
            p + "self_attn.rotary_emb.inv_freq": 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd),
            p + "mlp.gate_proj.weight": w(ff, h), p + "mlp.up_proj.weight": w(ff, h),
            p + "mlp.down_proj.weight": w(h, ff),
        })
    return sd


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, dict, dict]:
    return write_baichuan_release(tmp_path_factory.mktemp("baichuan") / "Baichuan2-7B-Chat")


def write_baichuan_release(src: Path) -> tuple[Path, dict, dict]:
    """Baichuan2-7B-Chat as shipped: pytorch_model.bin, the remote .py files (failing loudly if run), a
    sentencepiece model with Baichuan2's settings (no normalization, no dummy prefix, digits split, byte
    fallback) whose role pieces are control symbols, and the generation_config.json naming them.
    (src, its config, its tensors)."""
    import sentencepiece as spm

    make_sentencepiece_tokenizer(src, add_dummy_prefix=False, normalization_rule_name="identity",
                                 remove_extra_whitespaces=False, split_digits=True, control_symbols=ROLE_PIECES)
    (src / "tokenizer.vocab").unlink()
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    cfg = {**CONFIG, "vocab_size": sp.get_piece_size()}
    sd = baichuan_weights(cfg)
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    (src / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    user, assistant = (sp.piece_to_id(p) for p in ROLE_PIECES)
    (src / "generation_config.json").write_text(json.dumps({
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "user_token_id": user,
        "assistant_token_id": assistant, "max_new_tokens": 2048, "temperature": 0.3, "top_k": 5, "top_p": 0.85,
        "repetition_penalty": 1.05, "do_sample": True, "transformers_version": "4.29.2"}))
    for name in REMOTE_FILES:
        (src / name).write_text(REMOTE_CODE)
    return src, cfg, sd


# --- the oracle: Baichuan2-7B's forward (modeling_baichuan.py, eval mode, no cache), in fp32 ---------------

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def baichuan_reference(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    t, h, heads = len(ids), cfg["hidden_size"], cfg["num_attention_heads"]
    hd, eps = h // heads, cfg["rms_norm_eps"]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.cat([torch.outer(torch.arange(t).float(), inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        proj = F.linear(a, sd[p + "self_attn.W_pack.weight"])
        # proj.unflatten(-1, (3, hidden)) … proj[0], proj[1], proj[2]: q, k, v
        q, k, v = (proj.unflatten(-1, (3, h))[:, j].view(t, heads, hd) for j in range(3))
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + F.linear(torch.einsum("hqk,khd->qhd", probs, v).reshape(t, h), sd[p + "self_attn.o_proj.weight"])
        m = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = F.linear(m, sd[p + "mlp.gate_proj.weight"]), F.linear(m, sd[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, sd[p + "mlp.down_proj.weight"])
    # NormHead in eval mode: the weight's rows normalized (F.normalize), then a plain linear.
    return F.linear(rms_norm(x, sd["model.norm.weight"], eps), F.normalize(sd["lm_head.weight"]))


def build_chat_input(sp, messages: list[dict], user: int, assistant: int) -> list[int]:
    """Baichuan2's generation_utils.build_chat_input (no truncation): system tokens, then per message its
    role token and content, then the assistant token unless the last message is the assistant's."""
    ids: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            assert i == 0
        else:
            ids.append(user if m["role"] == "user" else assistant)
        ids += sp.encode(m["content"])
    if messages[-1]["role"] != "assistant":
        ids.append(assistant)
    return ids


def rel_err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def remote_modules() -> list[str]:
    names = {n[:-3] for n in REMOTE_FILES}
    return [m for m in sys.modules if m.startswith("transformers_modules") or m.split(".")[-1] in names]


MESSAGES = [{"role": "system", "content": "你是一个有用的助手。"}, {"role": "user", "content": "上海是哪个国家的城市？"},
            {"role": "assistant", "content": "中国 the model"}, {"role": "user", "content": "the cache keeps 2024 keys"}]


def test_tokenizer_and_chat_template(release):
    import sentencepiece as spm

    src, _, _ = release
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    tok = baichuan.load_tokenizer(src)
    user, assistant = (sp.piece_to_id(p) for p in ROLE_PIECES)
    for text in ["", "the model quantizes 12345 weights", "  two  spaces\n\nnewline", "上海是中国最大的城市 😀 é",
                 "x_12 = 345\tcache"]:
        assert tok(text)["input_ids"] == sp.encode(text), text  # no BOS: add_bos_token false
        assert tok.decode(tok(text)["input_ids"]) == text
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == ("你是一个有用的助手。<reserved_106>上海是哪个国家的城市？<reserved_107>中国 the model"
                    "<reserved_106>the cache keeps 2024 keys<reserved_107>")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert (ids if isinstance(ids, list) else ids["input_ids"]) == build_chat_input(sp, MESSAGES, user, assistant)
    assert tok.convert_tokens_to_ids(ROLE_PIECES) == [user, assistant]


def test_state_dict_conversion():
    h = 4
    w_pack = torch.arange(3 * h * h, dtype=torch.float32).view(3 * h, h)
    head = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    sd = {"model.layers.0.self_attn.W_pack.weight": w_pack, "lm_head.weight": head}
    out = baichuan.to_llama_state_dict(sd, {**CONFIG, "hidden_size": h})
    for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        assert torch.equal(out[f"model.layers.0.self_attn.{proj}.weight"], w_pack[j * h:(j + 1) * h])
    assert torch.allclose(out["lm_head.weight"], torch.tensor([[0.6, 0.8], [0.0, 1.0]]))
    # Baichuan-7B (the first one) has a plain lm_head: kept as it is.
    v1 = baichuan.to_llama_state_dict(sd, {**CONFIG, "hidden_size": h, "architectures": ["BaiChuanForCausalLM"]})
    assert torch.equal(v1["lm_head.weight"], head)


def test_logits_match_baichuan_reference(release):
    src, cfg, sd = release
    loaded = load_fp_model(src, dtype=torch.float32)
    assert loaded.spec.name == "baichuan" and type(loaded.model).__name__ == "LlamaForCausalLM"
    prompts, decode = make_prompts()
    with torch.no_grad():
        for ids in prompts:
            assert rel_err(loaded.model(ids[None]).logits[0], baichuan_reference(sd, cfg, ids)) <= 1e-4
        model, _, gen = load_decoder(src, "cpu", torch.float32)
        got = engine_logits(model, prompts, decode)
        for seq, prompt, dec in zip(got, prompts, decode):
            want = baichuan_reference(sd, cfg, torch.cat([prompt, dec]))
            assert rel_err(seq[0], want[:len(prompt)]) <= 1e-4
            for step, logits in enumerate(seq[1:]):
                assert rel_err(logits[0], want[len(prompt) + step]) <= 1e-4, step
    user = json.loads((src / "generation_config.json").read_text())["user_token_id"]
    assert gen.eos_token_id == [2, user] and loaded.model.generation_config.eos_token_id == [2, user]
    assert not remote_modules()


def test_quantize_export_reload_chat(release, tmp_path):
    import sentencepiece as spm

    src, cfg, sd = release
    export = quantkit.quantize(str(src), build_config(method="rtn", **{"weight.group_size": 32}),
                               work_dir=tmp_path / "q", progress=False).work_dir
    out_cfg = json.loads((export / "config.json").read_text())
    assert out_cfg["architectures"] == ["LlamaForCausalLM"] and out_cfg["model_type"] == "llama"
    assert "auto_map" not in out_cfg and not list(export.rglob("*.py"))
    assert "auto_map" not in json.loads((export / "tokenizer_config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    user, assistant = (sp.piece_to_id(p) for p in ROLE_PIECES)
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [2, user]

    hf, _ = quantkit.load(export, device="cpu")
    prompts, decode = make_prompts()
    model, _, _ = load_decoder(export, "cpu", torch.float32)
    with torch.no_grad():
        got = engine_logits(model, prompts, decode)
        for seq, prompt in zip(got, prompts):
            assert rel_err(seq[0], hf(prompt[None]).logits[0]) <= 1e-4
        # The export's lm_head is the normalized NormHead (kept in fp16, not quantized).
        assert torch.allclose(hf.lm_head.weight.float(), F.normalize(sd["lm_head.weight"]), atol=1e-3)
        q4 = hf(prompts[1][None]).logits[0]
        assert F.cosine_similarity(q4, baichuan_reference(sd, cfg, prompts[1]), dim=-1).min() > 0.9

    pipe = quantkit.pipeline(export, device="cpu")
    # (generation_config.json's repetition_penalty 1.05 would apply to greedy decoding too: turned off)
    out = pipe([MESSAGES], max_new_tokens=8, temperature=0, repetition_penalty=1.0, ignore_eos=True)[0]
    ids = build_chat_input(sp, MESSAGES, user, assistant)
    assert out.prompt_tokens == len(ids)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[-8:]
    assert not remote_modules()


def test_13b_alibi_is_refused(release, tmp_path, monkeypatch, capsys):
    _, cfg, _ = release
    big = tmp_path / "Baichuan2-13B-Chat"
    big.mkdir()
    # Baichuan2-13B's config: model_max_length, no max_position_embeddings (its attention is ALiBi).
    cfg13 = {k: v for k, v in cfg.items() if k != "max_position_embeddings"}
    (big / "config.json").write_text(json.dumps({**cfg13, "hidden_size": 5120, "intermediate_size": 13696}))
    with pytest.raises(UserError, match="ALiBi"):
        load_fp_model(big)
    with pytest.raises(UserError, match="ALiBi"):
        load_decoder(big, "cpu")
    monkeypatch.setattr(sys, "argv", ["quantkit", "rtn", str(big), "--work-dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exc:
        cli_main()
    err = capsys.readouterr().err
    assert exc.value.code not in (0, None) and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ALiBi" in errors[0], err
