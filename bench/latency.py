"""Batch-1 decode speed of the engine (tokens/s after the first token; the prompt excluded), on
random-weight models of real shapes: every combination of the flags' lists, one table.

    python -m bench.latency                                   # Llama-2-7B, Llama-3-8B, InternLM2-1.8B; W4 and fp16
    python -m bench.latency --shapes llama2-7b --weights w4 --kv-bits 16,8 --out latency.json
    python -m bench.latency --seed-table --out seed.json      # ChatGLM2-6B, Qwen-7B, Qwen-14B; fp16, W8, W4
    python -m bench.latency --seed-table --shapes qwen-14b    # one of them
    python -m bench.latency --tiny                            # CPU smoke run
Shapes: llama2-7b, llama3-8b, internlm2-1.8b, chatglm2-6b, qwen-7b, qwen-14b; weights: fp16, w8 (int8
weight-only, per channel), w4 (group 128). Also `quantkit bench latency` (one combination).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse

from quantkit.engine.benchmark import latency, run_grid

# The seed's single-batch table: vLLM, fp16 weights, batch 1, on an RTX A6000 (tokens/s).
SEED_VLLM_A6000_FP16 = {"chatglm2-6b": 51.9, "qwen-7b": 43.4, "qwen-14b": 24.2}
SEED_NOTE = ("seed_vllm_a6000_fp16: the seed's figure for the real model (vLLM, fp16, RTX A6000), beside ours "
             "on random weights of its shape; x_seed = decode_tok_s / that figure. Characters/s is not given: "
             "random weights decode to random tokens, so characters per token mean nothing here.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", help="default llama2-7b,llama3-8b,internlm2-1.8b (with --seed-table, its three)")
    ap.add_argument("--weights", help="default w4,fp16 (with --seed-table, fp16,w8,w4)")
    ap.add_argument("--kv-bits", default="16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed-table", action="store_true",
                    help="the seed's single-batch table: its three shapes × fp16, w8, w4, its vLLM figures beside")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    shapes = ",".join(SEED_VLLM_A6000_FP16) if args.seed_table else "llama2-7b,llama3-8b,internlm2-1.8b"
    weights = "fp16,w8,w4" if args.seed_table else "w4,fp16"
    shapes, weights = (args.shapes or shapes).split(","), (args.weights or weights).split(",")

    def measure(setup):
        row = latency(setup, args.input_len, args.output_len)
        if args.seed_table:
            seed = SEED_VLLM_A6000_FP16.get(setup.shape)
            row["seed_vllm_a6000_fp16"] = seed
            row["x_seed"] = round(row["decode_tok_s"] / seed, 1) if seed else None
        return row

    run_grid(measure, shapes, weights, [int(b) for b in args.kv_bits.split(",")], args.tiny, out=args.out)
    if args.seed_table:
        print(SEED_NOTE)


if __name__ == "__main__":
    main()
