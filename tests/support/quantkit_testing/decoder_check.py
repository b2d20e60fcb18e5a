"""The engine's decoder against transformers, step by step over a paged KV cache (tests/engine, and
tests/kernels with the Triton kernels under the interpreter).

A packed prefill of prompts of different lengths (contiguous block tables in a pool of 16-token
blocks, metadata made as the model runner makes it), then decode steps one token per sequence; the
reference is transformers one prompt at a time with its own cache.
"""

from __future__ import annotations

import copy
import math

import torch

from quantkit.engine.attention import AttnMetadata
from quantkit.engine.layers import use_kernels
from quantkit.kernels.paged_kv import PagedKV
from quantkit.kernels.settings import AUTO, KernelSettings

BLOCK = 16
PROMPT_LENS = (5, 20, 14)  # 20 spans two blocks; 14 + 4 decode steps crosses into a second block
DECODE_STEPS = 4


def make_prompts(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in PROMPT_LENS]
    decode = [torch.randint(3, 300, (DECODE_STEPS,), generator=g) for _ in PROMPT_LENS]
    return prompts, decode


def engine_step(model, tables: torch.Tensor, new: list[torch.Tensor], past: list[int], decode: bool) -> list[torch.Tensor]:
    """One engine step for every sequence: their new tokens packed, metadata made as the runner makes it."""
    positions = torch.cat([torch.arange(p, p + len(t)) for p, t in zip(past, new)])
    seq_of_token = torch.cat([torch.full((len(t),), b) for b, t in enumerate(new)])
    slots = tables[seq_of_token, positions // BLOCK].long() * BLOCK + positions % BLOCK
    counts = torch.tensor([len(t) for t in new])
    context_lens = [p + len(t) for p, t in zip(past, new)]
    query_start = [0, *counts.cumsum(0).tolist()]
    meta = AttnMetadata(
        slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start=torch.tensor(query_start, dtype=torch.int32), is_decode=decode,
        host_lens=(query_start, context_lens),
    )
    logits = model.compute_logits(model(torch.cat(new), positions, meta))
    return list(logits.split(counts.tolist()))


def engine_logits(model, prompts, decode_tokens, rotation: str = "none",
                  kernels: KernelSettings = AUTO) -> list[list[torch.Tensor]]:
    """Per sequence: [prefill logits [L, V], then one [1, V] per decode step]; `rotation`: the KV16 pool's
    (kernels/kv_rotation.py); `kernels`: the model's and the pool's (by default the torch code on the CPU)."""
    use_kernels(model, kernels)
    per_seq = math.ceil((max(PROMPT_LENS) + DECODE_STEPS) / BLOCK)
    tables = torch.arange(len(prompts) * per_seq, dtype=torch.int32).view(len(prompts), per_seq)
    model.set_kv_caches([
        PagedKV.allocate(tables.numel(), BLOCK, model.num_kv_heads, model.head_dim, 16, model.dtype, "cpu",
                         rotation=rotation, kernels=kernels)
        for _ in range(model.num_layers)
    ])
    out = [[x] for x in engine_step(model, tables, prompts, [0] * len(prompts), decode=False)]
    past = [len(p) for p in prompts]
    for i in range(DECODE_STEPS):
        new = [d[i:i + 1] for d in decode_tokens]
        for seq, x in zip(out, engine_step(model, tables, new, past, decode=True)):
            seq.append(x)
        past = [p + 1 for p in past]
    return out


def hf_logits(hf, prompts, decode_tokens) -> list[list[torch.Tensor]]:
    """The same, from transformers one prompt at a time with its own cache (a fresh copy per prompt:
    dynamic rope scaling keeps state between calls)."""
    out = []
    for prompt, dec in zip(prompts, decode_tokens):
        m = copy.deepcopy(hf)
        r = m(prompt[None], use_cache=True)
        seq, cache = [r.logits[0]], r.cache
        for tok in dec:
            r = m(tok.view(1, 1), cache=cache, use_cache=True)
            seq.append(r.logits[0])
            cache = r.cache
        out.append(seq)
    return out


def assert_same_logits(model, hf, rotation: str = "none", kernels: KernelSettings = AUTO) -> None:
    prompts, decode = make_prompts()
    with torch.no_grad():
        got, want = engine_logits(model, prompts, decode, rotation, kernels), hf_logits(hf, prompts, decode)
    for b, (g_seq, w_seq) in enumerate(zip(got, want)):
        for step, (g, w) in enumerate(zip(g_seq, w_seq)):
            err = (g - w.float()).abs().max() / w.abs().max()
            assert err <= 1e-4, f"sequence {b}, {'prefill' if step == 0 else f'decode step {step}'}: rel. err {err:.2e}"


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
