"""Asynchronous scheduling and start-up warm-up of the engine (issue #38), on random-weight models of real shapes.

    python -m bench.engine_async [--shapes llama2-7b,llama3-8b,internlm2-1.8b] [--weights w4,fp16] [--out F]
    python -m bench.engine_async --tiny                                         # CPU smoke run

One engine per (shape, weights), built with the warm-up traffic on; then, for each scheduling mode (the
engine's `async_scheduling` switched between runs, so both modes share the model, the pool and the graphs):
- b1: the decode CUDA graph of batch 1 replayed alone (CUDA events, at a 32-token context), and batch-1 decode
  through `Engine.step` (32-token prompt, 256 new tokens, greedy): mean time per output token (TPOT) and tok/s;
  TPOT / replay is the host's share left on the critical path;
- c64 (first shape and weights only, or --load-all): `bench serve`'s load without HTTP (512 prompt tokens,
  128 output tokens, EOS ignored, 64 requests kept in flight, 256 in all): output tok/s.
Then with --passes (first shape and weights): on the engine as it came up (warm-up only), c1 (4 requests),
c16 (64) and c64 (256), each level run twice: output tok/s of the first pass against the second, and the first
c1 request's TTFT against the mean TTFT of that pass.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time

import torch

from quantkit.engine.benchmark import BenchSetup, _random_prompts, _sync
from quantkit.engine.config import SamplingParams


def replay_ms(engine, repeats: int = 200) -> float | None:
    """The batch-1 decode graph replayed alone (its inputs as the last step left them)."""
    graph = engine.runner.graphs.get(1)
    if graph is None or engine.runner.device.type != "cuda":
        return None
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def batch1(engine, output_len: int = 256) -> dict:
    """Mean time per output token of one request through Engine.step (after the first token)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompt = _random_prompts(1, 32, engine.model.config.vocab_size, seed=5)[0]
    best = float("inf")
    for _ in range(3):
        stamps = []
        for out in engine.stream(prompt, params):
            stamps += [time.perf_counter()] * len(out.token_ids)
        best = min(best, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"tpot_ms": round(best * 1e3, 4), "tok_s": round(1 / best, 1)}


def load(engine, concurrency: int, requests: int, input_len: int = 512, output_len: int = 128,
         seed: int = 0) -> dict:
    """`concurrency` requests kept in flight (a new one added the moment one finishes), `requests` in all:
    output tok/s over the whole run, the TTFT of each request (from its add to its first token out)."""
    vocab = engine.model.config.vocab_size
    prompts = _random_prompts(requests, input_len, vocab, seed=seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    added, first, finished, produced = {}, {}, set(), 0
    queue = list(range(requests))
    _sync(engine)
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and len(added) - len(finished) < concurrency:
            i = queue.pop(0)
            added[engine.add_request(prompts[i], params, request_id=f"{seed}-{i}")] = time.perf_counter()
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
            produced += len(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
    _sync(engine)
    elapsed = time.perf_counter() - start
    ttfts = [first[r] - added[r] for r in sorted(added, key=added.get)]
    return {"concurrency": concurrency, "requests": requests, "output_tok_s": round(produced / elapsed, 1),
            "ttft_ms_first": round(ttfts[0] * 1e3, 1), "ttft_ms_mean": round(sum(ttfts) / len(ttfts) * 1e3, 1),
            "ttft_ms_max": round(max(ttfts) * 1e3, 1), "seconds": round(elapsed, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b,internlm2-1.8b")
    ap.add_argument("--weights", default="w4,fp16", help="the first shape runs each; the others the first only")
    ap.add_argument("--passes", action="store_true", help="first against second pass at c1/c16/c64 (first engine)")
    ap.add_argument("--load-all", action="store_true", help="the c64 load on every engine, not the first only")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (a smoke run)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    shapes, weights = args.shapes.split(","), args.weights.split(",")
    runs = [(shapes[0], w) for w in weights] + [(s, weights[0]) for s in shapes[1:]]
    if args.tiny:
        runs = [("tiny", weights[0])]
    rows = []
    for n, (shape, w) in enumerate(runs):
        setup = BenchSetup(shape, w, 16, tiny=args.tiny)
        began = time.perf_counter()
        engine = setup.engine(max_num_seqs=64, max_model_len=1024 if args.tiny else 2048, warmup=True,
                              async_scheduling=True)
        row = {**setup.describe(), "start_s": round(time.perf_counter() - began, 1)}
        if args.passes and n == 0:
            levels = ((1, 4), (16, 64), (64, 256)) if not args.tiny else ((1, 2), (4, 8))
            row["passes"] = [{"pass": p, **load(engine, c, r, seed=10 * c + p)} for c, r in levels for p in (1, 2)]
        row["replay_ms"] = replay_ms(engine)
        for mode in (False, True):
            engine.async_scheduling = mode
            key = "async" if mode else "sync"
            row[f"b1_{key}"] = batch1(engine, 64 if args.tiny else 256)
            if n == 0 or args.load_all:
                row[f"c64_{key}"] = load(engine, 64 if not args.tiny else 4, 256 if not args.tiny else 8,
                                         input_len=512 if not args.tiny else 32,
                                         output_len=128 if not args.tiny else 8, seed=99)
        if row["replay_ms"]:
            row["tpot_over_replay"] = {k: round(row[f"b1_{k}"]["tpot_ms"] / row["replay_ms"], 3)
                                       for k in ("sync", "async")}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
