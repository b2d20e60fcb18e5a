"""RTN and int8 on SmolLM2-135M-Instruct: PTB/WikiText-2 test perplexity against the fp32 model.

    python -m bench.foundation_smollm2 [--windows 40] [--seqlen 512] [--out runs/foundation]

Protocol: the plain one of quantkit.eval.perplexity (non-overlapping windows, first N), fp32 on the CPU.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time
from pathlib import Path

import torch

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.eval.perplexity import perplexity
from quantkit.models.loading import load_fp_model

from bench.lib.common import SHARED_DATA, smollm2_gguf

SCHEMES = {
    "int8 (per channel, sym)": QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)),
    "RTN W4 g64": QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 64)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--datasets", default="ptb,wikitext2")
    ap.add_argument("--out", default="runs/foundation")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    gguf = smollm2_gguf()
    datasets = args.datasets.split(",")
    rows = []

    def evaluate(name, model, tok, extra):
        ppl = {d: perplexity(model, tok, d, args.seqlen, args.windows, str(SHARED_DATA)).ppl for d in datasets}
        rows.append({"model": name, **{f"ppl_{d}": ppl[d] for d in datasets}, **extra})
        print(json.dumps(rows[-1]), flush=True)

    fp = load_fp_model(gguf, dtype=torch.float32)
    evaluate("fp32", fp.model, fp.tokenizer, {"seconds": 0})
    del fp
    for name, cfg in SCHEMES.items():
        t0 = time.perf_counter()
        res = quantkit.quantize(str(gguf), cfg, work_dir=out / cfg.method / str(cfg.weight.bits), overwrite=True, progress=False)
        secs = time.perf_counter() - t0
        model, tok = quantkit.load(res.work_dir, device="cpu")
        evaluate(name, model, tok, {"seconds": round(secs, 1)})
    base = rows[0]
    print(f"\n| model | " + " | ".join(f"{d} ppl | Δ %" for d in datasets) + " | quantize s |")
    print("|---|" + "---|---|" * len(datasets) + "---|")
    for r in rows:
        cells = " | ".join(f"{r[f'ppl_{d}']:.2f} | {100 * (r[f'ppl_{d}'] / base[f'ppl_{d}'] - 1):+.2f}" for d in datasets)
        print(f"| {r['model']} | {cells} | {r['seconds']} |")
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
