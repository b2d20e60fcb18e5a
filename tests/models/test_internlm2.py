"""InternLM2 without remote code: the checkpoint loads as Llama with the same logits, and its
sentencepiece tokenizer becomes a fast tokenizer that encodes as the original does."""

import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit import build_config
from quantkit.config import UserError
from quantkit.models.internlm2 import split_wqkv
from quantkit.models.loading import load_fp_model
from quantkit.models.tokenizer_convert import sentencepiece_to_fast
from quantkit_testing.tiny import TINY, llama_to_internlm2, make_text


def test_split_wqkv_grouping():
    heads, kv, hd, hidden = 4, 2, 3, 5
    g = heads // kv
    # Row r of head h in group j gets the value 1000*kind + 100*head + r.
    rows = []
    for j in range(kv):
        for i in range(g):
            rows += [[1000 * 0 + 100 * (j * g + i) + r] * hidden for r in range(hd)]
        rows += [[1000 * 1 + 100 * j + r] * hidden for r in range(hd)]
        rows += [[1000 * 2 + 100 * j + r] * hidden for r in range(hd)]
    q, k, v = split_wqkv(torch.tensor(rows, dtype=torch.float32), heads, kv)
    assert q[:, 0].tolist() == [100 * h + r for h in range(heads) for r in range(hd)]
    assert k[:, 0].tolist() == [1000 + 100 * j + r for j in range(kv) for r in range(hd)]
    assert v[:, 0].tolist() == [2000 + 100 * j + r for j in range(kv) for r in range(hd)]


def test_internlm2_logits_match_llama(tiny_models):
    a = load_fp_model(tiny_models["llama"], dtype=torch.float32)
    b = load_fp_model(tiny_models["internlm2"], dtype=torch.float32)
    assert json.loads((tiny_models["internlm2"] / "config.json").read_text())["architectures"] == ["InternLM2ForCausalLM"]
    assert b.spec.name == "internlm2" and b.model.__class__.__name__ == "LlamaForCausalLM"
    ids = torch.randint(3, 300, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(b.model(ids).logits, a.model(ids).logits, rtol=0, atol=1e-5)


# --- the tokenizer, as InternLM2 ships it ---------------------------------------------------------

ZH = "上海是中国最大的城市之一人口超过两千万我们今天去公园散步天气很好模型把权重量化成整数每组一个比例缓存保存每个词元的键和值"
# InternLM2's vocabulary holds placeholder pieces that tokenizer_config.json renames to its chat tokens.
CHAT_TOKENS = ("<|plugin|>", "<|interpreter|>", "<|action_end|>", "<|action_start|>", "<|im_end|>", "<|im_start|>")
PLACEHOLDERS = [f"[UNUSED_TOKEN_{141 + i}]" for i in range(len(CHAT_TOKENS))]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REMOTE_CODE = 'raise RuntimeError("remote code executed")\n'
SYSTEM = "你是一个有用的助手，回答要简短。"
USER = "Hi, pls intro yourself. 上海是哪个国家的城市？ The cache keeps keys 和值 for every token 😀."


def train_sentencepiece(**normalizer) -> bytes:
    """A real BPE sentencepiece model with byte fallback, trained on ~10 KB of English + Chinese text."""
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [line + " " + "".join(rng.choice(ZH) for _ in range(rng.randint(4, 16))) + "。"
             for line in make_text(1200, 3).splitlines()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=640, model_type="bpe", byte_fallback=True,
        user_defined_symbols=PLACEHOLDERS, character_coverage=0.9995, minloglevel=2, **normalizer,
    )
    return buf.getvalue()


# A code-friendly model: newlines, runs of spaces and text kept as written. The converter follows what the
# model stores, so the first test below also covers sentencepiece's defaults (dummy prefix, NFKC, spaces).
INTERNLM2_NORMALIZER = dict(add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity")


def internlm2_tokenizer_config(sp) -> dict:
    def token(content):
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": True}

    added = {0: "<unk>", 1: "<s>", 2: "</s>"}
    added.update({sp.piece_to_id(p): t for p, t in zip(PLACEHOLDERS, CHAT_TOKENS)})
    return {
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer",
                                       "tokenization_internlm2_fast.InternLM2TokenizerFast"]},
        "tokenizer_class": "InternLM2Tokenizer",
        "added_tokens_decoder": {str(i): token(t) for i, t in added.items()},
        "additional_special_tokens": list(CHAT_TOKENS),
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "decode_with_prefix_space": False, "chat_template": CHAT_TEMPLATE,
    }


def reference_ids(sp, text: str, config: dict) -> list[int]:
    """What InternLM2's own tokenizer does: split on the added tokens, sentencepiece on each piece between."""
    added = {t["content"]: int(i) for i, t in config["added_tokens_decoder"].items()}
    pattern = "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
    ids = []
    for part in re.split(pattern, text):
        if part in added:
            ids.append(added[part])
        elif part:
            ids += sp.encode(part)
    return ids


@pytest.fixture(scope="module")
def internlm2_release(tmp_path_factory) -> Path:
    """A checkpoint laid out as InternLM2 ships it: wqkv/wo/w1/w2/w3 weights, config and tokenizer_config
    with auto_map, tokenizer.model, and tokenization_internlm2*.py that fail loudly if anything runs them."""
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("internlm2_release")
    model_proto = train_sentencepiece(**INTERNLM2_NORMALIZER)
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": sp.get_piece_size()}))
    llama.save_pretrained(str(root / "llama"))
    src = llama_to_internlm2(root / "llama", root / "internlm2-chat")
    (src / "tokenizer.model").write_bytes(model_proto)
    (src / "tokenizer_config.json").write_text(json.dumps(internlm2_tokenizer_config(sp), indent=2, ensure_ascii=False))
    for name in ("tokenization_internlm2.py", "tokenization_internlm2_fast.py", "modeling_internlm2.py"):
        (src / name).write_text(REMOTE_CODE)
    # A chat turn ends with <|im_end|>: generation stops on it as on </s>.
    im_end = sp.piece_to_id(PLACEHOLDERS[CHAT_TOKENS.index("<|im_end|>")])
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, im_end],
                                                            "pad_token_id": 2}))
    return src


@pytest.mark.parametrize("normalizer", [INTERNLM2_NORMALIZER, {}], ids=["internlm2", "sentencepiece-defaults"])
def test_converted_tokenizer_encodes_as_sentencepiece(tmp_path, normalizer):
    import sentencepiece as spm

    model_proto = train_sentencepiece(**normalizer)
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    (tmp_path / "tokenizer.model").write_bytes(model_proto)
    tok = sentencepiece_to_fast(tmp_path / "tokenizer.model", {"add_bos_token": False})
    rng = random.Random(1)
    alphabet = list(ZH + "the cache keeps keys, values.:_=0123456789") + [" ", "  ", "\n", "\t", "😀", "é", "Ω", "—"]
    texts = ["", " ", "  two  spaces  ", "\n\nnewlines\n", "上海是 the 缓存 😀", "x_12 = 345"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for text in texts:
        assert tok(text)["input_ids"] == sp.encode(text), text
        assert tok.decode(tok(text)["input_ids"]) == sp.decode(sp.encode(text)), text
    # With InternLM2's tokenizer_config: chat tokens split the text, each piece between is encoded alone.
    config = internlm2_tokenizer_config(sp)
    chat = sentencepiece_to_fast(tmp_path / "tokenizer.model", config)
    alphabet += list(CHAT_TOKENS) + ["<s>", "</s>"]
    texts = [f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n", " <|im_end|> x<s>  "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for text in texts:
        assert chat(text)["input_ids"] == [sp.bos_id()] + reference_ids(sp, text, config), text


def test_internlm2_release_quantizes_and_loads_without_remote_code(internlm2_release, tmp_path, monkeypatch):
    import sentencepiece as spm
    import transformers

    src = internlm2_release
    config = json.loads((src / "tokenizer_config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))

    def no_auto_tokenizer(*args, **kwargs):
        raise AssertionError(f"AutoTokenizer.from_pretrained{args} on a checkpoint with remote tokenizer code")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_auto_tokenizer)
    res = quantkit.quantize(str(src), build_config(method="rtn", **{"weight.group_size": 32}),
                            work_dir=tmp_path / "q", progress=False)
    monkeypatch.undo()
    export = res.work_dir
    assert not list(export.rglob("*.py"))
    assert "auto_map" not in json.loads((export / "tokenizer_config.json").read_text())
    assert "auto_map" not in json.loads((export / "config.json").read_text())
    im_end = next(int(i) for i, t in config["added_tokens_decoder"].items() if t["content"] == "<|im_end|>")
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [2, im_end]

    # A fresh process, offline, with no terminal to answer a prompt: a request to run code fails there.
    child = """
import json, sys
from transformers import AutoTokenizer
import quantkit
export, text, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ids = lambda out: out if isinstance(out, list) else out["input_ids"]
tok = AutoTokenizer.from_pretrained(export)
loaded_model, loaded_tok = quantkit.load(export, device="cpu")
plain = tok(text)["input_ids"]
print(json.dumps({
    "chat_text": tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
    "chat_ids": ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)),
    "load_chat_ids": ids(loaded_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)),
    "plain_ids": plain, "load_plain_ids": loaded_tok(text)["input_ids"],
    "decoded": tok.decode(plain, skip_special_tokens=True),
    "eos": loaded_model.generation_config.eos_token_id,
    "remote_modules": [m for m in sys.modules if m.startswith(("transformers_modules", "tokenization_internlm2"))],
}))
"""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    text = USER + "\n" + SYSTEM
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", child, str(export), text, json.dumps(messages)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    want_chat = f"<s><|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n"
    assert got["chat_text"] == want_chat
    want_chat_ids = reference_ids(sp, want_chat, config)
    assert want_chat_ids[:2] == [1, sp.piece_to_id("[UNUSED_TOKEN_146]")]  # BOS, then <|im_start|>'s id
    assert got["chat_ids"] == got["load_chat_ids"] == want_chat_ids
    want_plain = [sp.bos_id()] + sp.encode(text)  # BOS first, no EOS, as InternLM2's tokenizer does
    assert got["plain_ids"] == got["load_plain_ids"] == want_plain
    assert got["decoded"] == text
    assert got["remote_modules"] == []
    assert got["eos"] == [2, im_end]  # quantkit.load keeps the export's EOS list: chat stops at <|im_end|>


def test_remote_tokenizer_without_sentencepiece_model_is_refused(internlm2_release, tmp_path):
    import shutil

    src = shutil.copytree(internlm2_release, tmp_path / "no-spm")
    (src / "tokenizer.model").unlink()
    with pytest.raises(UserError, match="remote code .* no tokenizer.model"):
        load_fp_model(src)
