"""Perplexity through the inference engine: our decoder over its paged KV pool, so a quantized cache
(kv_bits 8 or 4, per-token per-head scales) is what the measurement sees.

The protocol is `eval.perplexity`'s (whole text tokenized once, non-overlapping windows, mean NLL of
every predicted token). Each window runs as one sequence's prefill, in chunks of `chunk` tokens; every
chunk writes its K/V into the pool and attention then reads the whole context back from the pool,
dequantized, its own tokens included. Later chunks therefore read the earlier chunks' codes, and every
query sees exactly the K/V that decoding the window token by token would read (codes are per token, so
the chunk size does not change them).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any, Optional, Sequence as Seq

import torch
from tqdm.auto import tqdm

from quantkit.config import UserError
from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.engine.config import EngineConfig
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.sequence import Sequence
from quantkit.eval.compare import Comparison, ModelRow
from quantkit.eval.perplexity import PerplexityResult


def engine_runner(model: Any, kv_bits: int, seqlen: int, chunk: int, kv_scales: str = "online",
                  kv_stats: Optional[str] = None) -> ModelRunner:
    """A runner over `model` whose pool holds one window of `seqlen` tokens at `kv_bits`, coded with
    `kv_scales` (static: the per-head scales of the statistics file `kv_stats`)."""
    if seqlen > model.max_positions:
        raise UserError(f"--seqlen {seqlen} is longer than the model's context ({model.max_positions} tokens): "
                        "choose a smaller --seqlen")
    block = EngineConfig.block_size
    config = EngineConfig(kv_bits=kv_bits, num_kv_tokens=math.ceil(seqlen / block) * block, max_model_len=seqlen,
                          max_num_batched_tokens=chunk, cuda_graphs=False, enable_prefix_caching=False,
                          kv_scales=kv_scales, kv_stats=kv_stats)
    return ModelRunner(model, config)


def engine_perplexity_of_windows(runner: ModelRunner, windows: torch.Tensor, chunk: int, progress: bool = True,
                                 desc: str = "ppl") -> tuple[float, int]:
    """Mean NLL (nats) over every predicted token of `windows` [k, seqlen], and the token count. Every
    window reuses the pool's first blocks: its chunks write each slot before attention reads it."""
    total, count = 0.0, 0
    for w in tqdm(windows, desc=desc, disable=not progress, unit="window"):
        seq = Sequence(w.tolist())
        seq.block_table = list(range(math.ceil(len(seq) / runner.block_size)))
        logits = []
        while seq.num_computed_tokens < len(seq):
            n = min(chunk, len(seq) - seq.num_computed_tokens)
            logits.append(runner.prompt_logits([(seq, n)]))
            seq.num_computed_tokens += n
        ids = w.to(runner.device)
        total += torch.nn.functional.cross_entropy(torch.cat(logits)[:-1], ids[1:], reduction="sum").item()
        count += len(ids) - 1
    return total / count, count


def engine_perplexity(model: Any, tokenizer: Any, dataset: str = "ptb", seqlen: int = 2048,
                      windows: Optional[int] = None, data_dir: Optional[str] = None, kv_bits: int = 16,
                      chunk: Optional[int] = None, progress: bool = True, kv_scales: str = "online",
                      kv_stats: Optional[str] = None) -> PerplexityResult:
    """Perplexity of a `DecoderModel` (engine.model.load_decoder) on the test split of `dataset`, its
    K/V in a paged pool of `kv_bits` (16: the model's dtype; 8, 4: online per-token codes, or with
    kv_scales "static" the per-head scales of the statistics file `kv_stats`). Windows run as prefills
    of `chunk` tokens (default: the whole window)."""
    text, source = load_text(dataset, "test", data_dir)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    chunk = chunk or seqlen
    runner = engine_runner(model, kv_bits, seqlen, chunk, kv_scales, kv_stats)
    kv = kv_label(kv_bits, kv_scales)
    nll, count = engine_perplexity_of_windows(runner, win, chunk, progress, f"ppl {source.name} {kv}")
    model.set_kv_caches([None] * model.num_layers)  # the pool goes with the runner
    return PerplexityResult(math.exp(nll), nll, count, win.shape[0], seqlen, source.name, kv)


def kv_label(kv_bits: int, kv_scales: str = "online") -> str:
    return "engine fp" if kv_bits == 16 else f"engine KV{kv_bits} {kv_scales}"


def evaluate_on_engine(paths: Seq[str | Path], datasets: Seq[str] = ("ptb",), seqlen: int = 2048,
                       windows: Optional[int] = None, data_dir: Optional[str] = None, kv_bits: Seq[int] = (16,),
                       device: Optional[str] = None, progress: bool = True, kv_scales: str = "online",
                       kv_stats: Optional[str] = None) -> Comparison:
    """`quantkit eval ppl --engine`: each model directory loaded once as the engine's decoder, its
    perplexity on each dataset under each KV setting, as rows of the comparison table. Static KV scales
    come from `kv_stats` (a file or directory), else from each model directory's statistics."""
    from quantkit.engine.kv_scales import stats_file_for
    from quantkit.engine.model import load_decoder
    from quantkit.eval.loading import _weight_fields, checkpoint_size, is_checkpoint

    for b in kv_bits:
        EngineConfig(kv_bits=b, kv_scales=kv_scales)  # refuse --kv-bits 3 before loading anything
    for p in map(Path, paths):
        if not p.is_dir():
            raise UserError(f"{p} is not a model directory: the engine reads HF directories and quantkit "
                            "checkpoints (convert a .gguf with load_fp_model + save_pretrained, or drop --engine)")
    static = kv_scales == "static" and any(b != 16 for b in kv_bits)
    stats = {str(p): str(stats_file_for(p, kv_stats)) if static else None for p in map(Path, paths)}  # fail now
    rows: list[ModelRow] = []
    names: list[str] = []
    for p in map(Path, paths):
        model, tokenizer, _ = load_decoder(p, device)
        method, bits, group = _weight_fields(p) if is_checkpoint(p) else ("fp", 16, None)
        for b in kv_bits:
            row = ModelRow(p.name, str(p), method, bits, group, kv_label(b, kv_scales), checkpoint_size(p))
            for d in datasets:
                res = engine_perplexity(model, tokenizer, d, seqlen, windows, data_dir, b, progress=progress,
                                        kv_scales=kv_scales, kv_stats=stats[str(p)])
                row.ppl[res.dataset], row.tokens[res.dataset] = res.ppl, res.tokens
            names = list(row.ppl)
            rows.append(row)
        del model
        gc.collect()
    return Comparison(rows, names, seqlen, windows)
