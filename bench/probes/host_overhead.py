"""Host time of one engine step, the model's forward replaced by zeros: scheduling, step inputs, sampling,
postprocessing and outputs only (what runs on the CPU while a GPU would wait). CPU, tiny random model.

    PYTHONPATH=. python3 -m bench.probes.host_overhead [--batch 256] [--profile]

`batch` sequences with 512-token prompts are prefilled (with the real forward), then the forward is stubbed
and decode steps are timed: best of 5 × 60 steps.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import cProfile
import pstats
import time

import torch

from quantkit.engine.benchmark import BenchSetup, _random_prompts
from quantkit.engine.config import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="then 30 steps under cProfile, by own time")
    args = ap.parse_args()
    b = args.batch
    engine = BenchSetup(tiny=True, weights="fp16").engine(max_num_seqs=b, max_model_len=1000, num_kv_tokens=b * 1000)
    params = SamplingParams(max_tokens=450, temperature=0.0, ignore_eos=True)
    for prompt in _random_prompts(b, 512, engine.model.config.vocab_size):
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    hidden, vocab = engine.model.config.hidden_size, engine.model.config.vocab_size
    engine.runner._forward = lambda step: torch.zeros(step.input_ids.shape[0], hidden)
    engine.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    for _ in range(3):
        engine.step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(60):
            engine.step()
        best = min(best, (time.perf_counter() - start) / 60)
    print(f"batch {b}: host time per decode step {best * 1e3:.3f} ms (best of 5 × 60 steps)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
