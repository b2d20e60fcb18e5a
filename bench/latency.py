"""Batch-1 decode speed of the engine (tokens/s after the first token; the prompt excluded), on
random-weight models of real shapes: every combination of the flags' lists, one table.

    python bench/latency.py                                   # Llama-2-7B, Llama-3-8B, InternLM2-1.8B; W4 and fp16
    python bench/latency.py --shapes llama2-7b --weights w4 --kv-bits 16,8 --out latency.json
    python bench/latency.py --tiny                            # CPU smoke run
Also `quantkit bench latency` (one combination).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json

import torch

from quantkit.engine.benchmark import BenchSetup, latency, print_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b,internlm2-1.8b")
    ap.add_argument("--weights", default="w4,fp16")
    ap.add_argument("--kv-bits", default="16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    rows = []
    for shape, weights, bits in itertools.product(shapes, args.weights.split(","), args.kv_bits.split(",")):
        rows.append(latency(BenchSetup(shape, weights, int(bits), args.tiny), args.input_len, args.output_len))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if torch.cuda.is_available() and not args.tiny:
        print(torch.cuda.get_device_name())
    print_rows(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
