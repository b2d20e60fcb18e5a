"""Qwen (v1) without remote code: a checkpoint laid out as QWenLMHeadModel ships it (transformer.h.N.attn.c_attn
…, config.json and qwen.tiktoken as published, scaled down) loads as Qwen2 with the logits of a reference
forward written here from Qwen's published modeling code, its tiktoken vocabulary becomes a fast tokenizer
that encodes as tiktoken does, and it quantizes, exports (Qwen2ForCausalLM), reloads and generates."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
import unicodedata
from collections import Counter
from pathlib import Path

import pytest
import regex
import torch
import torch.nn.functional as F
from quantkit_testing.decoder_check import engine_logits, make_prompts
from quantkit_testing.tiny import make_text

import quantkit
from quantkit.config import UserError, build_config
from quantkit.engine.model import load_decoder
from quantkit.models import qwen
from quantkit.models.loading import load_fp_model

REMOTE_CODE = 'raise RuntimeError("remote code executed")\n'
REMOTE_FILES = ("modeling_qwen.py", "configuration_qwen.py", "tokenization_qwen.py", "qwen_generation_utils.py")
ZH = "上海是中国最大的城市之一人口超过两千万我们今天去公园散步天气很好模型把权重量化成整数每组一个比例缓存保存每个词元的键和值"
N_MERGES = 160
VOCAB = 640  # the embedding is padded past the tokenizer's ids, as Qwen's 151936 > 151851
# Qwen-7B-Chat's config.json, scaled down (seq_length < max_position_embeddings as in Qwen-14B-Chat).
CONFIG = {
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False, "fp32": False,
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 256, "kv_channels": 16,
    "layer_norm_epsilon": 1e-06, "max_position_embeddings": 256, "model_type": "qwen", "no_bias": True,
    "num_attention_heads": 4, "num_hidden_layers": 2, "onnx_safe": None, "rotary_emb_base": 10000,
    "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": 64, "softmax_in_fp32": False,
    "tie_word_embeddings": False, "tokenizer_class": "QWenTokenizer", "transformers_version": "4.32.0",
    "use_cache": True, "use_cache_kernel": False, "use_cache_quantization": False, "use_dynamic_ntk": True,
    "use_flash_attn": "auto", "use_logn_attn": True, "vocab_size": VOCAB,
}


# --- the vocabulary: tiktoken ranks trained here, and tiktoken's encoding as the oracle -------------------

def training_text() -> str:
    rng = __import__("random").Random(0)
    lines = [line + " " + "".join(rng.choice(ZH) for _ in range(rng.randint(4, 12))) + "。 I'll say it's 2024."
             for line in make_text(900, 5).splitlines()]
    return "\n".join(lines)


def train_ranks(text: str, n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE on Qwen's pre-tokenized pieces: the 256 bytes, then the most frequent pair, merged."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(regex.findall(qwen.PATTERN, text))
    seqs = {w: [bytes([b]) for b in w.encode()] for w in words}
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:]):
                pairs[pair] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """What Qwen's tokenizer does: NFC, special tokens matched anywhere (allowed_special="all"), Qwen's
    regular expression, then per piece tiktoken's byte-pair merge (the lowest-ranked adjacent pair first,
    the leftmost on a tie; a piece that is a token is taken whole)."""
    specials = {t: len(ranks) + i for i, t in enumerate(qwen.SPECIAL_TOKENS)}
    split = "(" + "|".join(re.escape(t) for t in specials) + ")"
    ids: list[int] = []
    for part in re.split(split, unicodedata.normalize("NFC", text)):
        if part in specials:
            ids.append(specials[part])
            continue
        for piece in regex.findall(qwen.PATTERN, part):
            parts = [bytes([b]) for b in piece.encode()]
            if piece.encode() in ranks:
                parts = [piece.encode()]
            while len(parts) > 1:
                cands = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                         if parts[i] + parts[i + 1] in ranks]
                if not cands:
                    break
                _, i = min(cands)
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            ids += [ranks[p] for p in parts]
    return ids


TEXTS = [
    "", " ", "hello world", "Hi, pls intro yourself", "上海是中国最大的城市", "I'll say it's 2024: 12345 apples!",
    "THE CACHE'S KEYS'LL", "  two  spaces\n\n\nnewlines\t\ttabs  \n ", "e\u0301t\u00e9 caf\u0065\u0301",
    "emoji 😀👍 and — dashes", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "x<|extra_3|>y<|endoftext|>",
    "the model quantizes weights into groups of integers 量化 每组一个比例",
]


# --- the checkpoint, as Qwen ships it ------------------------------------------------------------------

def qwen_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, ff, v = cfg["hidden_size"], cfg["intermediate_size"] // 2, cfg["vocab_size"]

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return torch.rand(h, generator=g) + 0.5

    sd = {"transformer.wte.weight": w(v, h, std=0.5), "transformer.ln_f.weight": norm(), "lm_head.weight": w(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        sd.update({
            p + "ln_1.weight": norm(), p + "ln_2.weight": norm(),
            p + "attn.c_attn.weight": w(3 * h, h, std=0.15), p + "attn.c_attn.bias": w(3 * h, std=0.3),
            p + "attn.c_proj.weight": w(h, h),
            p + "mlp.w1.weight": w(ff, h), p + "mlp.w2.weight": w(ff, h), p + "mlp.c_proj.weight": w(h, ff),
        })
    return sd


@pytest.fixture(scope="module")
def qwen_release(tmp_path_factory) -> tuple[Path, dict[bytes, int]]:
    return write_qwen_release(tmp_path_factory.mktemp("qwen") / "Qwen-7B-Chat")


def write_qwen_release(src: Path) -> tuple[Path, dict[bytes, int]]:
    """Qwen-7B-Chat as shipped, scaled down, in the new directory `src`: (src, the tiktoken ranks)."""
    from safetensors.torch import save_file

    src.mkdir()
    ranks = train_ranks(training_text(), N_MERGES)
    assert len(ranks) + len(qwen.SPECIAL_TOKENS) <= VOCAB
    (src / "qwen.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (src / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(qwen_weights(CONFIG), str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 8192, "tokenizer_class": "QWenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    endoftext = len(ranks)
    (src / "generation_config.json").write_text(json.dumps({
        "chat_format": "chatml", "eos_token_id": endoftext, "pad_token_id": endoftext, "max_window_size": 6144,
        "max_new_tokens": 512, "do_sample": True, "top_k": 0, "top_p": 0.8, "repetition_penalty": 1.1}))
    for name in REMOTE_FILES:
        (src / name).write_text(REMOTE_CODE)
    return src, ranks


# --- the oracle: Qwen's forward (modeling_qwen.py, no cache), in fp32 ------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def qwen_reference(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor, prompt_len: int | None = None) -> torch.Tensor:
    """Logits [T, vocab] of QWenLMHeadModel on one sequence `ids` [T] (eval mode, batch 1, no padding): a
    prefill of its first `prompt_len` tokens (default all), then the rest one token at a time."""
    t, h, heads, hd = len(ids), cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_channels"]
    s, eps = cfg["seq_length"], cfg["layer_norm_epsilon"]
    # Dynamic NTK: QWenModel.get_ntk_alpha of the prefill's length, kept for the decode steps (its cached
    # list); logn scaling of the queries at positions p with p + 1 > seq_length.
    n = prompt_len or t
    alpha = max(2 ** math.ceil(math.log(n / s, 2) + 1) - 1, 1) if cfg["use_dynamic_ntk"] else 1.0
    base = cfg["rotary_emb_base"] * alpha ** (hd / (hd - 2))
    inv_freq = 1.0 / base ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rotate(x):  # [T, heads, hd]; _rotate_half: (x1, x2) → (−x2, x1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    logn = torch.tensor([math.log(i, s) if i > s else 1.0 for i in range(1, t + 1)])[:, None, None]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = sd["transformer.wte.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        a = rms_norm(x, sd[p + "ln_1.weight"], eps)
        q, k, v = F.linear(a, sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]).split(h, dim=-1)
        q, k, v = (z.view(t, heads, hd) for z in (q, k, v))
        q, k = rotate(q), rotate(k)
        if t > s and cfg["use_logn_attn"]:
            q = q * logn
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~causal, torch.finfo(scores.dtype).min).softmax(-1)
        ctx = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, h)
        x = x + F.linear(ctx, sd[p + "attn.c_proj.weight"])
        m = rms_norm(x, sd[p + "ln_2.weight"], eps)
        a1, a2 = F.linear(m, sd[p + "mlp.w1.weight"]), F.linear(m, sd[p + "mlp.w2.weight"])
        x = x + F.linear(a1 * F.silu(a2), sd[p + "mlp.c_proj.weight"])
    return F.linear(rms_norm(x, sd["transformer.ln_f.weight"], eps), sd["lm_head.weight"])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def remote_modules() -> list[str]:
    return [m for m in sys.modules if m.startswith("transformers_modules") or m.split(".")[-1] in
            {n[:-3] for n in REMOTE_FILES}]


# --- tests -------------------------------------------------------------------------------------------

def test_tokenizer_encodes_as_tiktoken(qwen_release):
    src, ranks = qwen_release
    tok = qwen.load_tokenizer(src)
    rng = __import__("random").Random(3)
    alphabet = list(ZH + "the cache keeps keys, values.:_=0123456789'sTLL") + [" ", "  ", "\n", "\t", "😀", "é", "e\u0301"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50))) for _ in range(200)]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == tiktoken_encode(text, ranks), text
        assert tok.decode(ids) == unicodedata.normalize("NFC", text), text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_204|>"]) == \
        [len(ranks), len(ranks) + 1, len(ranks) + 2, len(ranks) + 207]
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token is None
    try:  # the oracle itself against tiktoken, where it is installed
        import tiktoken
    except ImportError:
        return
    enc = tiktoken.Encoding("qwen-tiny", pat_str=qwen.PATTERN, mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + i for i, t in enumerate(qwen.SPECIAL_TOKENS)})
    for text in texts:
        assert enc.encode(unicodedata.normalize("NFC", text), allowed_special="all") == tiktoken_encode(text, ranks)


def test_chat_template_is_qwen_chatml(qwen_release):
    src, ranks = qwen_release
    tok = qwen.load_tokenizer(src)
    im_start, im_end = len(ranks) + 1, len(ranks) + 2

    def enc(text):
        return tiktoken_encode(text, ranks)

    history = [{"role": "user", "content": "上海是哪个国家的城市？"}, {"role": "assistant", "content": "中国。"},
               {"role": "user", "content": "Hi, pls intro yourself"}]
    text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\n上海是哪个国家的城市？<|im_end|>\n<|im_start|>assistant\n中国。<|im_end|>\n"
                    "<|im_start|>user\nHi, pls intro yourself<|im_end|>\n<|im_start|>assistant\n")
    # Qwen's make_context: each role and content encoded alone, joined by <|im_start|>, <|im_end|> and "\n".
    nl = enc("\n")

    def turn(role, content):
        return [im_start] + enc(role) + nl + enc(content) + [im_end]

    want = turn("system", "You are a helpful assistant.")
    for m in history:
        want += nl + turn(m["role"], m["content"])
    want += nl + [im_start] + enc("assistant") + nl
    ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
    assert (ids if isinstance(ids, list) else ids["input_ids"]) == want
    own_system = tok.apply_chat_template([{"role": "system", "content": "be brief"}, history[0]], tokenize=False)
    assert own_system.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")


def test_config_conversion():
    out = qwen.qwen2_config_dict(CONFIG)
    assert out["intermediate_size"] == CONFIG["intermediate_size"] // 2  # Qwen's config doubles the MLP width
    assert (out["rms_norm_eps"], out["rope_theta"], out["max_position_embeddings"]) == (1e-6, 10000.0, 256)
    assert out["architectures"] == ["Qwen2ForCausalLM"] and out["num_key_value_heads"] == 4
    with pytest.raises(UserError, match="rotary_pct 0.5"):
        qwen.qwen2_config_dict({**CONFIG, "rotary_pct": 0.5})
    with pytest.raises(UserError, match="kv_channels 8"):
        qwen.qwen2_config_dict({**CONFIG, "kv_channels": 8})


def test_logits_match_qwen_reference(qwen_release):
    src, _ = qwen_release
    sd = qwen_weights(CONFIG)
    loaded = load_fp_model(src, dtype=torch.float32)
    assert loaded.spec.name == "qwen" and type(loaded.model).__name__ == "Qwen2ForCausalLM"
    prompts, decode = make_prompts()
    with torch.no_grad():
        for ids in prompts:
            assert rel_err(loaded.model(ids[None]).logits[0], qwen_reference(sd, CONFIG, ids)) <= 1e-4
        # The engine's decoder: a packed prefill of three prompts over the paged KV cache, then decode steps.
        model, _, gen = load_decoder(src, "cpu", torch.float32)
        assert model.family == "qwen2"
        got = engine_logits(model, prompts, decode)
        for seq, prompt, dec in zip(got, prompts, decode):
            full = torch.cat([prompt, dec])
            assert len(full) <= CONFIG["seq_length"]  # where Qwen's NTK and logn scaling are no-ops
            want = qwen_reference(sd, CONFIG, full)
            assert rel_err(seq[0], want[:len(prompt)]) <= 1e-4
            for step, logits in enumerate(seq[1:]):
                assert rel_err(logits[0], want[len(prompt) + step]) <= 1e-4, step
    n = len(qwen_release[1])
    assert gen.eos_token_id == [n + 2, n] and loaded.model.generation_config.eos_token_id == [n + 2, n]
    assert not remote_modules()


def test_quantize_export_reload_generate(qwen_release, text_file, tmp_path):
    src, ranks = qwen_release
    config = build_config(method="awq", **{"awq.n_grid": 4, "awq.search_tokens": 64, "calib.batch_size": 4,
                                           "calib.samples": 4, "calib.seqlen": 32, "weight.group_size": 32})
    export = quantkit.quantize(str(src), config, calib=str(text_file), work_dir=tmp_path / "q", progress=False).work_dir
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2" and "auto_map" not in cfg
    assert cfg["quantization_config"]["quant_method"] == "awq"
    assert cfg["logn_attention_length"] == CONFIG["seq_length"]  # read by the engine, ignored by transformers
    assert not list(export.rglob("*.py")) and (export / "tokenizer.json").is_file()
    assert "auto_map" not in json.loads((export / "tokenizer_config.json").read_text())
    n = len(ranks)
    gen_cfg = json.loads((export / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == [n + 2, n] and gen_cfg["top_p"] == 0.8

    # quantkit.load (transformers' Qwen2 with packed linears) and the engine read the same export alike.
    hf, tok = quantkit.load(export, device="cpu")
    model, etok, _ = load_decoder(export, "cpu", torch.float32)
    prompts, decode = make_prompts()
    with torch.no_grad():
        got = engine_logits(model, prompts, decode)
        for seq, prompt in zip(got, prompts):
            assert rel_err(seq[0], hf(prompt[None]).logits[0]) <= 1e-4
        # The quantized model stays close to the original (4-bit weights: close, not equal).
        want = qwen_reference(qwen_weights(CONFIG), CONFIG, prompts[1])
        q4 = hf(prompts[1][None]).logits[0]
        assert F.cosine_similarity(q4, want, dim=-1).min() > 0.9
    assert tok(TEXTS[5])["input_ids"] == etok(TEXTS[5])["input_ids"] == tiktoken_encode(TEXTS[5], ranks)

    # Greedy generation: the engine's tokens are transformers' argmax, step by step.
    pipe = quantkit.pipeline(export, device="cpu")
    messages = [{"role": "user", "content": "Hi, pls intro yourself"}]
    # (generation_config.json's repetition_penalty 1.1 would apply to greedy decoding too: turned off)
    out = pipe([messages], max_new_tokens=8, temperature=0, repetition_penalty=1.0, ignore_eos=True)[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    assert ids[:1] == [n + 1] and out.prompt_tokens == len(ids)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[-8:]
    assert not remote_modules()

    # quantkit chat on the export: the same greedy answer as the pipeline's (the model's own penalty).
    want = pipe([messages], max_new_tokens=6, temperature=0)[0].text
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "chat", str(export), "--device", "cpu",
                           "--max-new-tokens", "6", "--temperature", "0"], input="Hi, pls intro yourself\nexit\n",
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.split(">>> ")[1]
    assert want.strip() and want.strip() in answer


def test_engine_reproduces_logn_attention_past_seq_length(qwen_release, tmp_path):
    """Prompts within seq_length (Qwen's NTK alpha stays 1) and answers past it: Qwen scales the queries at
    positions p ≥ seq_length by log_seq_length(p + 1), and so does the engine."""
    import shutil

    src = shutil.copytree(qwen_release[0], tmp_path / "seq16")
    cfg = {**CONFIG, "seq_length": 16}
    (src / "config.json").write_text(json.dumps(cfg))
    sd = qwen_weights(CONFIG)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (5, 15, 16)]
    decode = [torch.randint(3, 300, (4,), generator=g) for _ in prompts]
    with torch.no_grad():
        model, _, _ = load_decoder(src, "cpu", torch.float32)
        got = engine_logits(model, prompts, decode)
        for seq, prompt, dec in zip(got, prompts, decode):
            full = torch.cat([prompt, dec])
            want = qwen_reference(sd, cfg, full, prompt_len=len(prompt))
            assert rel_err(seq[0], want[:len(prompt)]) <= 1e-4
            for step, logits in enumerate(seq[1:]):
                assert rel_err(logits[0], want[len(prompt) + step]) <= 1e-4, step
        # The check has teeth: without the logn factor the last answer tokens' logits differ.
        plain = qwen_reference(sd, {**cfg, "use_logn_attn": False}, full, prompt_len=len(prompt))
        assert rel_err(plain[-1], want[-1]) > 1e-3


def test_missing_vocabulary_is_refused(qwen_release, tmp_path):
    import shutil

    src = shutil.copytree(qwen_release[0], tmp_path / "no-vocab")
    (src / "qwen.tiktoken").unlink()
    with pytest.raises(UserError, match="needs its qwen.tiktoken"):
        load_fp_model(src)
