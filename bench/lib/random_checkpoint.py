"""Write a random-weight Hugging Face checkpoint of a real shape, with a given tokenizer, for the benchmarks
that need a model directory (transformers' `generate` and `transformers serve` beside the engine).

    python -m bench.lib.random_checkpoint llama2-7b OUT --tokenizer TOKENIZER_DIR [--device cuda]

The vocabulary is the tokenizer's (e.g. SmolLM2's 49,152 tokens in place of Llama-2's 32,000), so the
text decodes; the weights are N(0, 0.02) in fp16 — speed does not depend on their values.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
from pathlib import Path

import torch


def write(shape: str, out: Path, tokenizer_dir: Path, device: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from quantkit.engine.random_model import shape_config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = shape_config(shape)
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(out), max_shard_size="4GB")
    tok.save_pretrained(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape")
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    write(args.shape, args.out, args.tokenizer, args.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
