"""Where a batch-1 decode step of the engine spends its time on the GPU (random-weight real shapes).

    PYTHONPATH=. python3 -m bench.probes.engine_step_profile [--shape llama2-7b] [--weights w4] [--steps 20]

1. The graphed engine: wall time per decode step (`Engine.step`, host work included) and the replay of
   the step's CUDA graph alone (CUDA events), at a 32-token context.
2. The same model decoding eagerly under torch.profiler: the kernels' GPU time per step, grouped by
   kernel name, so the graph's time can be split into linears, attention, norms and the rest.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import time

import torch

from quantkit.engine.benchmark import BenchSetup, _random_prompts
from quantkit.engine.config import SamplingParams


def _decoding_engine(setup: BenchSetup, graphs: bool):
    engine = setup.engine(max_num_seqs=1, max_model_len=1024, cuda_graphs=graphs)
    prompt = _random_prompts(1, 32, engine.model.config.vocab_size)[0]
    engine.add_request(prompt, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # prefill, then a few decode steps (kernels compiled)
        engine.step()
    torch.cuda.synchronize()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--weights", default="w4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    setup = BenchSetup(args.shape, args.weights, 16, cache_max_entry_count=0.3)

    engine = _decoding_engine(setup, graphs=True)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    graph = engine.runner.graphs[1]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = begin.elapsed_time(end) / args.steps
    print(f"{args.shape} {args.weights}: Engine.step {step_ms:.3f} ms ({1e3 / step_ms:.0f} tok/s), "
          f"graph replay alone {replay_ms:.3f} ms ({1e3 / replay_ms:.0f} tok/s)", flush=True)
    del engine, graph
    torch.cuda.empty_cache()

    engine = _decoding_engine(setup, graphs=False)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / args.steps
    print(f"eager: kernels' GPU time per step {total / 1e3:.3f} ms")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]:
        per_step = e.device_time_total / args.steps
        print(f"{per_step:9.1f} µs/step {e.count // args.steps:5d}×  {100 * per_step / total:5.1f} %  {e.key[:90]}")


if __name__ == "__main__":
    main()
