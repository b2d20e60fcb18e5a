"""Perplexity by the plain protocol: tokenize the whole text once (no special tokens), cut it into
non-overlapping windows of `seqlen`, take the mean negative log-likelihood over every predicted
token (seqlen − 1 per window), and exponentiate. No BOS, no striding, no overlap.

This module runs a transformers model (`eval ppl --reference`: transformers' own modeling code, an
independent check of the engine, with no KV-cache quantization); eval/engine_perplexity.py runs the
engine's decoder over its paged KV pool by the same protocol, which is what `eval ppl` does by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from quantkit.data import evaluation_windows, load_text, tokenize_text


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    tokens: int
    windows: int
    seqlen: int
    dataset: str
    kv: str = "KV16"  # what the KV cache stored: "KV16" (unquantized) or e.g. "KV4 per token, keys rotated"


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """float32 logits [seqlen, vocab] of every position of one window, from a transformers model."""
    device = next(model.parameters()).device
    return model(window[None].to(device), use_cache=False).logits[0].float()


def window_nll(logits: torch.Tensor, window: torch.Tensor) -> float:
    """Summed NLL (nats) of the window's tokens 1… given the logits of positions 0…"""
    return torch.nn.functional.cross_entropy(logits[:-1], window[1:].to(logits.device), reduction="sum").item()


def perplexity(model: torch.nn.Module, tokenizer: Any, dataset: str = "ptb", seqlen: int = 2048,
               windows: Optional[int] = None, data_dir: Optional[str] = None,
               progress: bool = True) -> PerplexityResult:
    """Perplexity of a transformers `model` on the test split of `dataset` (a name or a .txt/.jsonl path)."""
    text, source = load_text(dataset, "test", data_dir)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    total = sum(window_nll(reference_logits(model, w), w)
                for w in tqdm(win, desc=f"ppl {source.name}", disable=not progress, unit="window"))
    count = win.shape[0] * (seqlen - 1)
    return PerplexityResult(math.exp(total / count), total / count, count, win.shape[0], seqlen, source.name)
