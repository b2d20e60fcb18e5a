"""Tiny random models of several architectures and a tokenizer, made by the tests themselves (no download)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

WORDS = ("the model quantizes weights into groups of integers and a scale per group while the "
         "cache keeps keys and values for every token of the prompt").split()


def make_text(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)) + " .")
    return "\n".join(lines)


def make_tokenizer():
    """A small byte-level BPE tokenizer trained on the tests' own text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([make_text(2000, 1)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**TINY, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
    raise ValueError(arch)


def make_tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    # Spread the weights so that quantization error is visible but the model stays stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.ndim == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.02)
    return model.eval()


def write_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    model = make_tiny_model(arch, seed)
    model.save_pretrained(str(directory))
    make_tokenizer().save_pretrained(str(directory))
    return directory


def llama_to_internlm2(llama_dir: Path, out_dir: Path) -> Path:
    """Write an InternLM2-layout checkpoint (wqkv/wo/w1/w2/w3) holding the same weights as a Llama dir."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((llama_dir / "config.json").read_text())
    sd = load_file(str(llama_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    g = heads // kv
    out = {}
    for name, t in sd.items():
        if ".self_attn.q_proj." in name:
            prefix = name.split(".self_attn.")[0]
            q = t.reshape(kv, g, hd, -1)
            k = sd[f"{prefix}.self_attn.k_proj.weight"].reshape(kv, 1, hd, -1)
            v = sd[f"{prefix}.self_attn.v_proj.weight"].reshape(kv, 1, hd, -1)
            out[f"{prefix}.attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1]).contiguous()
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        for a, b in ((".self_attn.o_proj.", ".attention.wo."), (".mlp.gate_proj.", ".feed_forward.w1."),
                     (".mlp.up_proj.", ".feed_forward.w3."), (".mlp.down_proj.", ".feed_forward.w2."),
                     (".input_layernorm.", ".attention_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                     ("model.embed_tokens.", "model.tok_embeddings."), ("lm_head.", "output.")):
            name = name.replace(a, b)
        out[name] = t.contiguous()
    # Every weight lands under an InternLM2 name (k and v inside wqkv): a name the mapping missed would
    # leave a Llama tensor the InternLM2 loader never reads, and the tests would compare less than they say.
    layers = cfg["num_hidden_layers"]
    assert len(out) == len(sd) - 2 * layers, (len(out), len(sd))
    left = [n for n in out if any(s in n for s in ("self_attn", ".mlp.", "layernorm", "embed_tokens", "lm_head"))]
    assert not left, left
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    icfg = {
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
        "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": 10000.0, "bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }
    (out_dir / "config.json").write_text(json.dumps(icfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (llama_dir / f).exists():
            (out_dir / f).write_bytes((llama_dir / f).read_bytes())
    return out_dir


def make_sentencepiece_tokenizer(directory: Path, **normalizer):
    """A small sentencepiece BPE with byte fallback (characters outside its vocabulary become byte tokens),
    trained on English and Chinese text, as a transformers fast tokenizer. `normalizer`: sentencepiece
    trainer options (e.g. add_dummy_prefix=False)."""
    import sentencepiece as spm

    from quantkit.models.tokenizer_convert import sentencepiece_to_fast

    zh = "上海是中国最大的城市之一人口超过两千万我们今天去公园散步天气很好模型把权重量化成整数每组一个比例缓存保存每个词元的键和值"
    rng = random.Random(0)
    lines = [line + " " + "".join(rng.choice(zh) for _ in range(rng.randint(4, 16))) + "。"
             for line in make_text(1200, 3).splitlines()]
    directory.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, minloglevel=2, **normalizer)
    return sentencepiece_to_fast(directory / "tokenizer.model", {"add_bos_token": True})


def write_tiny_glm(directory: Path, num_key_value_heads: int = 2, seed: int = 0) -> Path:
    """A tiny transformers GlmForCausalLM (rotary on half of each head in adjacent pairs, q/k/v bias, one
    gate_up_proj) with the tests' tokenizer, as GLM-4's transformers releases are laid out."""
    from transformers import GlmConfig, GlmForCausalLM

    torch.manual_seed(seed)
    config = GlmConfig(**{**TINY, "num_key_value_heads": num_key_value_heads}, head_dim=16, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    model = GlmForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * (0.08 if p.ndim == 2 else 0.1))
    model.save_pretrained(str(directory))
    make_tokenizer().save_pretrained(str(directory))
    return directory


def poison_sampler(engine, seed: int, exc: Exception) -> None:
    """Make `engine`'s sampler raise `exc` for any batch holding a request of this seed (a request whose
    settings break sampling); other batches are sampled as before."""
    sample = engine.sampler.__call__

    def poisoned(logits, seqs):
        if any(s.params.seed == seed for s in seqs):
            raise exc
        return sample(logits, seqs)

    engine.sampler = poisoned
