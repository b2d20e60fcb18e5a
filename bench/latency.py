"""Batch-1 decode speed of the engine (tokens/s after the first token; the prompt excluded), on
random-weight models of real shapes: every combination of the flags' lists, one table.

    python -m bench.latency                                   # Llama-2-7B, Llama-3-8B, InternLM2-1.8B; W4 and fp16
    python -m bench.latency --shapes llama2-7b --weights w4 --kv-bits 16,8 --out latency.json
    python -m bench.latency --tiny                            # CPU smoke run
Also `quantkit bench latency` (one combination).
"""

from __future__ import annotations

import argparse

from quantkit.engine.benchmark import latency, run_grid


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
    measure = lambda setup: latency(setup, args.input_len, args.output_len)  # noqa: E731
    run_grid(measure, args.shapes.split(","), args.weights.split(","), [int(b) for b in args.kv_bits.split(",")],
             args.tiny, out=args.out)


if __name__ == "__main__":
    main()
