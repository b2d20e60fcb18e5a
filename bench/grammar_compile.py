"""Structured output's own costs, per tokenizer: a JSON schema's compile time (first, and again from the
cache), the host time to fill one sequence's token bitmask per step, and the time to apply a batch's
bitmasks to its logits (on the GPU when there is one).

    python -m bench.grammar_compile                                   # byte tokenizer of 32,000 ids (random:llama2-7b)
    python -m bench.grammar_compile --tokenizer DIR --tokenizer DIR2  # real tokenizers
    python -m bench.grammar_compile --schema bench/schemas/record.json --json OUT.json
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from quantkit.engine.structured import GrammarMask, Grammars, StructuredOutput

SCHEMA = Path(__file__).with_name("schemas") / "record.json"


def measure(name: str, tokenizer, vocab_size: int, schema: dict, batch: int, steps: int, device: str) -> dict:
    grammar = StructuredOutput.json_schema(schema)
    t = time.perf_counter()
    grammars = Grammars(tokenizer, vocab_size)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammars.compile(grammar)
    first = time.perf_counter() - t
    t = time.perf_counter()
    grammars.compile(grammar)
    cached = time.perf_counter() - t

    class Seq:   # what GrammarMask reads of a sequence
        def __init__(self) -> None:
            self.grammar = grammars.matcher(grammar, frozenset(tokenizer.all_special_ids))

    seqs = [Seq() for _ in range(batch)]
    mask = GrammarMask()
    rng = random.Random(0)
    logits = torch.randn(batch, vocab_size, device=device)
    fill, apply = [], []
    for _ in range(steps):
        x = logits.clone()
        t = time.perf_counter()
        bitmask = mask._buffer(batch, vocab_size, x.device)
        for i, s in enumerate(seqs):
            s.grammar.matcher.fill_next_token_bitmask(bitmask, i)
        fill.append((time.perf_counter() - t) / batch)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        masked = mask.apply(x, seqs, copy=False)
        if device == "cuda":
            torch.cuda.synchronize()
        apply.append(time.perf_counter() - t)
        for s, row in zip(seqs, masked):   # a random allowed token: the walk visits many grammar states
            allowed = torch.isfinite(row).nonzero().flatten().tolist()
            token = rng.choice(allowed)
            if s.grammar.matcher.accept_token(token) and s.grammar.is_terminated():
                s.grammar.matcher.reset()
    return {"tokenizer": name, "vocab": vocab_size, "setup_ms": setup * 1e3, "compile_ms": first * 1e3,
            "cached_ms": cached * 1e3, "fill_us_per_seq": statistics.median(fill) * 1e6,
            "apply_batch_us": statistics.median(apply) * 1e6, "batch": batch, "device": device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tokenizer", action="append", default=[], help="a tokenizer directory (repeatable)")
    ap.add_argument("--random-vocab", type=int, default=32000, help="the byte tokenizer `quantkit serve random:…` "
                    "uses, of this many ids, when no --tokenizer is given")
    ap.add_argument("--schema", type=Path, default=SCHEMA, help="the JSON schema (default bench/schemas/record.json)")
    ap.add_argument("--batch", type=int, default=16, help="constrained sequences per step")
    ap.add_argument("--steps", type=int, default=200, help="steps of the random walk through the grammar")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    schema = json.loads(args.schema.read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    if args.tokenizer:
        from transformers import AutoTokenizer

        for path in args.tokenizer:
            tok = AutoTokenizer.from_pretrained(path)
            rows.append(measure(Path(path).name, tok, len(tok), schema, args.batch, args.steps, device))
    else:
        from quantkit.server.model_source import byte_tokenizer

        tok = byte_tokenizer(args.random_vocab)
        rows.append(measure(f"byte-{args.random_vocab}", tok, args.random_vocab, schema, args.batch, args.steps,
                            device))
    print(f"schema {args.schema} · {device} · batch {args.batch}")
    print("| tokenizer | vocab | tokenizer info ms | compile ms | cached ms | fill µs/seq/step | apply µs/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['vocab']} | {r['setup_ms']:.0f} | {r['compile_ms']:.1f} | {r['cached_ms']:.3f} "
              f"| {r['fill_us_per_seq']:.0f} | {r['apply_batch_us']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
