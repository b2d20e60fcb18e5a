"""Next-token logits and perplexity through the inference engine: our decoder over its paged KV pool, so
the KV cache the measurement sees is what `chat`, `pipeline` and `serve` store (kernels/paged_kv.py:
the model's dtype at kv_bits 16; int8 / int4 codes with one fp16 scale and uint8 zero per token and
head at 8 / 4, online or static, after a Hadamard rotation where `kv_rotation` resolves to one).

The protocol is `eval.perplexity`'s (whole text tokenized once, non-overlapping windows, mean NLL of
every predicted token). Each window runs as one sequence's prefill, in chunks of `chunk` tokens; every
chunk writes its K/V into the pool and attention then reads the whole context back from the pool,
dequantized, its own tokens included. Later chunks therefore read the earlier chunks' codes, and every
query sees exactly the K/V that decoding the window token by token would read (codes are per token, so
the chunk size does not change them).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from quantkit.config import UserError
from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.engine.config import EngineConfig
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.sequence import Sequence
from quantkit.eval.perplexity import PerplexityResult, window_nll


def kv_label(runner: ModelRunner) -> str:
    """What a runner's pool stores, for tables: "KV16", "KV8 per token", "KV4 per token, keys centred +
    rotated" (keys rotated, and centred where the model has key centres), "KV4 static per head"."""
    pool = runner.kv_caches[0]
    if pool.bits == 16:
        return "KV16"
    label = f"KV{pool.bits} " + ("per token" if pool.static is None else "static per head")
    if pool.rotation is None:
        return label
    centred = runner.model.model.layers[0].self_attn.attn.k_center is not None
    return label + (", keys centred + rotated" if centred else ", keys rotated")


def engine_runner(model: Any, kv_bits: int, seqlen: int, chunk: Optional[int] = None, kv_scales: str = "online",
                  kv_stats: Optional[str] = None, kv_rotation: str = "auto") -> ModelRunner:
    """A runner over `model` whose pool holds one window of `seqlen` tokens at `kv_bits`, coded with
    `kv_scales` (static: the per-head scales of the statistics file `kv_stats`) and `kv_rotation`."""
    if seqlen > model.max_positions:
        raise UserError(f"--seqlen {seqlen} is longer than the model's context ({model.max_positions} tokens): "
                        "choose a smaller --seqlen")
    block = EngineConfig.block_size
    config = EngineConfig(kv_bits=kv_bits, num_kv_tokens=math.ceil(seqlen / block) * block, max_model_len=seqlen,
                          max_num_batched_tokens=chunk or seqlen, cuda_graphs=False, enable_prefix_caching=False,
                          kv_scales=kv_scales, kv_stats=kv_stats, kv_rotation=kv_rotation)
    return ModelRunner(model, config)


@torch.inference_mode()
def window_logits(runner: ModelRunner, window: torch.Tensor, chunk: Optional[int] = None) -> torch.Tensor:
    """float32 logits [seqlen, vocab] of every position of one window, prefilled in chunks of `chunk` tokens
    into the runner's pool (its first blocks, reused by every window). Several runners may share one
    model (one per KV setting): the runner's pool is bound to the model first."""
    runner.model.set_kv_caches(runner.kv_caches)
    seq = Sequence(window.tolist())
    seq.block_table = list(range(math.ceil(len(seq) / runner.block_size)))
    chunk = chunk or runner.config.max_num_batched_tokens
    logits = []
    while seq.num_computed_tokens < len(seq):
        n = min(chunk, len(seq) - seq.num_computed_tokens)
        logits.append(runner.prompt_logits([(seq, n)]))
        seq.num_computed_tokens += n
    return torch.cat(logits)


def engine_perplexity(model: Any, tokenizer: Any, dataset: str = "ptb", seqlen: int = 2048,
                      windows: Optional[int] = None, data_dir: Optional[str] = None, kv_bits: int = 16,
                      chunk: Optional[int] = None, progress: bool = True, kv_scales: str = "online",
                      kv_stats: Optional[str] = None, kv_rotation: str = "auto") -> PerplexityResult:
    """Perplexity of a `DecoderModel` (engine.model.load_decoder) on the test split of `dataset`, its K/V in
    a paged pool of `kv_bits` (see `engine_runner`). Windows run as prefills of `chunk` tokens (default:
    the whole window)."""
    text, source = load_text(dataset, "test", data_dir)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    runner = engine_runner(model, kv_bits, seqlen, chunk, kv_scales, kv_stats, kv_rotation)
    kv = kv_label(runner)
    total = sum(window_nll(window_logits(runner, w), w)
                for w in tqdm(win, desc=f"ppl {source.name} {kv}", disable=not progress, unit="window"))
    model.set_kv_caches([None] * model.num_layers)  # the pool goes with the runner
    count = win.shape[0] * (seqlen - 1)
    return PerplexityResult(math.exp(total / count), total / count, count, win.shape[0], seqlen, source.name, kv)
