"""Host time of the sampler's penalties per decode step: counts rebuilt from every sequence's whole token lists
(the sampler before it kept token state, rebuilt here) against the kept state of `PenaltyTokens`. CPU.

    PYTHONPATH=. python3 -m bench.probes.penalty_overhead [--seqs 64] [--contexts 512 4096 16384]

Each of `seqs` sequences has a prompt of context − 64 tokens and 64 output tokens, with Qwen2.5's repetition
penalty (1.05) and presence / frequency penalties 0.5 / 0.3; a step appends one token to each and applies the
penalties. Two vocabularies: Qwen2.5's 151,936, where on the CPU the [seqs, vocab] tensor arithmetic (device
work on a GPU) is timed too, and 1,024, where it is negligible and what is left is the host work.
Best of 3 × 10 steps; the kept state's first call (building the rows from the prompts) apart.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import platform
import time

import torch

from quantkit.engine.config import SamplingParams
from quantkit.engine.sampler import PenaltyTokens
from quantkit.engine.sequence import Sequence


def rebuilt_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The former `sampler.apply_penalties`: token counts rebuilt from each sequence's lists at every call."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
    if not rows:
        return logits
    vocab, dev = logits.shape[1], logits.device
    sub = [seqs[i] for i in rows]
    seen = _token_counts([s.token_ids for s in sub], vocab, dev) > 0
    counts = _token_counts([s.output_token_ids for s in sub], vocab, dev)
    rep = torch.tensor([s.params.repetition_penalty for s in sub], device=dev)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in sub], device=dev)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in sub], device=dev)[:, None]
    x = logits[rows]
    logits = logits.clone()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - presence * (counts > 0) - frequency * counts
    logits[rows] = x
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)
    for i, t in enumerate(token_lists):
        padded[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def sequences(n: int, context: int, vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(context)
    params = SamplingParams(repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.3)
    seqs = []
    for tokens in torch.randint(0, vocab, (n, context), generator=g).tolist():
        s = Sequence(tokens[:-64], params)
        for t in tokens[-64:]:
            s.append_token(t)
        seqs.append(s)
    return seqs


def per_step(apply, seqs: list[Sequence], logits: torch.Tensor, steps: int = 10, repeats: int = 3) -> float:
    """Best of `repeats` × `steps` (append one token each, apply), seconds per step."""
    best = float("inf")
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            for s in seqs:
                s.append_token((r * steps + i) % logits.shape[1])
            apply(logits, seqs)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    args = ap.parse_args()
    print(f"{args.seqs} sequences, CPU: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'vocab':>8} {'context':>8} {'rebuilt ms/step':>16} {'kept ms/step':>13} {'speed-up':>9} "
          f"{'kept 1st call ms':>17}")
    for vocab in (151936, 1024):
        for context in args.contexts:
            logits = torch.randn(args.seqs, vocab, generator=torch.Generator().manual_seed(1))
            old = per_step(rebuilt_penalties, sequences(args.seqs, context, vocab), logits)
            seqs, pen = sequences(args.seqs, context, vocab), PenaltyTokens()
            start = time.perf_counter()
            first = pen.apply(logits, seqs)
            first_s = time.perf_counter() - start
            assert torch.equal(first, rebuilt_penalties(logits, seqs))
            new = per_step(pen.apply, seqs, logits)
            assert torch.equal(pen.apply(logits, seqs), rebuilt_penalties(logits, seqs))
            print(f"{vocab:>8} {context:>8} {old * 1e3:>16.2f} {new * 1e3:>13.2f} {old / new:>8.1f}× "
                  f"{first_s * 1e3:>17.1f}")


if __name__ == "__main__":
    main()
