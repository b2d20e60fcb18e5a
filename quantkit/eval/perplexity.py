"""Perplexity by the plain protocol: tokenize the whole text once (no special tokens), cut it into
non-overlapping windows of `seqlen`, take the mean negative log-likelihood over every predicted
token (seqlen − 1 per window), and exponentiate. No BOS, no striding, no overlap.

With a quantized KV cache (kv_bits 8 or 4) each window goes through a fresh `QuantizedKVCache`,
in chunks of `factory.chunk` tokens (32 for KV4 online, whose keys are coded per group of 32 tokens;
the whole window at once otherwise). The cache codes values — and keys, except those of a group
still being filled — as they are written, and attention reads them back decoded, each token's own
included. Chunks aligned with the key groups give every query exactly the K/V it would read when
decoding the window token by token through the cache: the error a user of `generate` sees, at the
cost of a few forwards per window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.formats.kv_stats import KVStats
from quantkit.runtime.kv_cache import KVCacheFactory, KVCacheSettings, cache_arg_name, kv_cache_factory


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    tokens: int
    windows: int
    seqlen: int
    dataset: str
    kv: str = "fp"  # "fp" (unquantized cache) or e.g. "KV8 online"


@torch.inference_mode()
def perplexity_of_windows(model: torch.nn.Module, windows: torch.Tensor, progress: bool = True, desc: str = "ppl",
                          kv_cache: Optional[Callable[[], Any]] = None,
                          on_logits: Optional[Callable[[int, torch.Tensor], None]] = None,
                          **forward_kwargs: Any) -> tuple[float, int]:
    """Mean NLL (nats) over every predicted token of `windows` [k, seqlen], and the token count.

    `kv_cache` makes a fresh cache per window (e.g. a `KVCacheFactory`); None runs without a cache.
    `on_logits(i, logits)` sees each window's float logits [seqlen, vocab] (e.g. for top-1 agreement).
    """
    device = next(model.parameters()).device
    cache_arg = cache_arg_name(model)
    total, count = 0.0, 0
    for i, w in enumerate(tqdm(windows, desc=desc, disable=not progress, unit="window")):
        ids = w.unsqueeze(0).to(device)
        if kv_cache is None:
            logits = model(ids, use_cache=False, **forward_kwargs).logits.float()
        else:
            cache, step = kv_cache(), getattr(kv_cache, "chunk", None) or ids.shape[1]
            logits = torch.cat([model(ids[:, s:s + step], use_cache=True, **{cache_arg: cache}, **forward_kwargs)
                                .logits.float() for s in range(0, ids.shape[1], step)], dim=1)
        if on_logits is not None:
            on_logits(i, logits[0])
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        total += nll.item()
        count += ids.shape[1] - 1
    return total / count, count


def resolve_kv_cache(model: torch.nn.Module, kv_bits: Optional[int], kv_scales: str = "online",
                     kv_stats: Optional[KVStats] = None) -> Optional[KVCacheFactory]:
    """The cache factory perplexity uses: None for kv_bits 16; the model's attached one for kv_bits None."""
    if kv_bits is None:
        return kv_cache_factory(model)
    if kv_bits == 16:
        return None
    return KVCacheFactory(model.config, KVCacheSettings(kv_bits, kv_scales, kv_stats))


def perplexity(model: torch.nn.Module, tokenizer: Any, dataset: str = "ptb", seqlen: int = 2048,
               windows: Optional[int] = None, data_dir: Optional[str] = None, progress: bool = True,
               kv_bits: Optional[int] = None, kv_scales: str = "online", kv_stats: Optional[KVStats] = None,
               ) -> PerplexityResult:
    """Perplexity of `model` on the test split of `dataset` (a name or a .txt/.jsonl path).

    `kv_bits` 8 or 4 evaluates through a quantized KV cache (`kv_scales` online, or static from
    `kv_stats`); 16 through none; None through the cache attached by `quantkit.load(…, kv_bits=…)`, if any.
    """
    factory = resolve_kv_cache(model, kv_bits, kv_scales, kv_stats)
    text, source = load_text(dataset, "test", data_dir)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    kv = factory.settings.describe() if factory else "fp"
    nll, count = perplexity_of_windows(model, win, progress=progress, desc=f"ppl {source.name} {kv}", kv_cache=factory)
    return PerplexityResult(math.exp(nll), nll, count, win.shape[0], seqlen, source.name, kv)
