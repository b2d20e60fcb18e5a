"""Offline throughput of the engine (vLLM's benchmark_throughput): N requests of fixed input and output
lengths, all submitted at once; output tokens/s. Random-weight models of real shapes; every
combination of the flags' lists, one table.

    python -m bench.throughput                                # Llama-2-7B W4, 512 × 512 in / 128 out, KV 16 and 8
    python -m bench.throughput --shapes llama3-8b --weights w4,fp16 --num-prompts 256 --out tp.json
    python -m bench.throughput --tiny                         # CPU smoke run
Also `quantkit bench throughput` (one combination).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse

from quantkit.engine.benchmark import run_grid, throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama2-7b")
    ap.add_argument("--weights", default="w4")
    ap.add_argument("--kv-bits", default="16,8")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cache-max-entry-count", type=float, default=0.8)
    ap.add_argument("--max-num-seqs", type=int, default=512, help="most sequences running at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    measure = lambda setup: throughput(setup, args.num_prompts, args.input_len, args.output_len,  # noqa: E731
                                       args.max_num_seqs, args.max_num_batched_tokens)
    run_grid(measure, args.shapes.split(","), args.weights.split(","), [int(b) for b in args.kv_bits.split(",")],
             args.tiny, args.cache_max_entry_count, args.out)


if __name__ == "__main__":
    main()
