"""Offline throughput of the engine (vLLM's benchmark_throughput): N requests of fixed input and output
lengths, all submitted at once; output tokens/s. Random-weight models of real shapes; every
combination of the flags' lists, one table.

    python bench/throughput.py                                # Llama-2-7B W4, 512 × 512 in / 128 out, KV 16 and 8
    python bench/throughput.py --shapes llama3-8b --weights w4,fp16 --num-prompts 256 --out tp.json
    python bench/throughput.py --tiny                         # CPU smoke run
Also `quantkit bench throughput` (one combination).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json

import torch

from quantkit.engine.benchmark import BenchSetup, print_rows, throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama2-7b")
    ap.add_argument("--weights", default="w4")
    ap.add_argument("--kv-bits", default="16,8")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cache-max-entry-count", type=float, default=0.8)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    rows = []
    for shape, weights, bits in itertools.product(shapes, args.weights.split(","), args.kv_bits.split(",")):
        setup = BenchSetup(shape, weights, int(bits), args.tiny, args.cache_max_entry_count)
        rows.append(throughput(setup, args.num_prompts, args.input_len, args.output_len))
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
