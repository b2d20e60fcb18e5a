"""Perplexity by the plain protocol: tokenize the whole text once (no special tokens), cut it into
non-overlapping windows of `seqlen`, take the mean negative log-likelihood over every predicted
token (seqlen − 1 per window), and exponentiate. No BOS, no striding, no overlap."""

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


@torch.inference_mode()
def perplexity_of_windows(model: torch.nn.Module, windows: torch.Tensor, progress: bool = True, desc: str = "ppl",
                          **forward_kwargs: Any) -> tuple[float, int]:
    """Mean NLL (nats) over every predicted token of `windows` [k, seqlen], and the token count."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for w in tqdm(windows, desc=desc, disable=not progress, unit="window"):
        ids = w.unsqueeze(0).to(device)
        logits = model(ids, use_cache=False, **forward_kwargs).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total += nll.item()
        count += ids.shape[1] - 1
    return total / count, count


def perplexity(model: torch.nn.Module, tokenizer: Any, dataset: str = "ptb", seqlen: int = 2048,
               windows: Optional[int] = None, data_dir: Optional[str] = None, progress: bool = True) -> PerplexityResult:
    """Perplexity of `model` on the test split of `dataset` (a name or a .txt/.jsonl path)."""
    text, source = load_text(dataset, "test", data_dir)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    nll, count = perplexity_of_windows(model, win, progress=progress, desc=f"ppl {source.name}")
    return PerplexityResult(math.exp(nll), nll, count, win.shape[0], seqlen, source.name)
