"""KV-cache capacity and long-context decode speed of the engine, fp16 KV against int8/int4 KV.

    python -m bench.long_context                 # capacity (Llama-2-7B W4, KV 16/8/4) and the two long-context cases
    python -m bench.long_context --part capacity --out cap.json
    python -m bench.long_context --tiny          # CPU smoke run

Capacity: tokens in the KV pool at cache_max_entry_count 0.8. Long context: decode tok/s of batch 1 at
8k tokens (Llama-3-8B shape: the Llama-2 shape's context is 4k) and batch 32 at 4k (Llama-2-7B shape,
3,968-token prompts + 64 decoded = 4,032 positions), prompts prefilled first and not timed.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse

from quantkit.engine.benchmark import capacity, long_context, run_grid

CASES = {  # name: (shape, batch, context)
    "b1-8k": ("llama3-8b", 1, 8064),
    "b32-4k": ("llama2-7b", 32, 3968),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "capacity", "long"), default="all")
    ap.add_argument("--kv-bits", default="16,8,4")
    ap.add_argument("--weights", default="w4")
    ap.add_argument("--cases", default=",".join(CASES), help=f"long-context cases: {', '.join(CASES)}")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (short contexts)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    bits = [int(b) for b in args.kv_bits.split(",")]
    weights = args.weights.split(",")
    rows = []
    if args.part in ("all", "capacity"):
        rows += run_grid(capacity, ["llama2-7b"], weights, bits, args.tiny)
    if args.part in ("all", "long"):
        for name in args.cases.split(","):
            shape, batch, context = CASES[name]
            if args.tiny:
                batch, context = min(batch, 4), 200
            measure = lambda setup: long_context(setup, batch, context, args.output_len)  # noqa: E731
            rows += run_grid(measure, [shape], weights, bits, args.tiny)
    if args.out:
        import json

        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
