"""Where the engine's offline throughput run (`bench throughput`) spends its time, step by step.

    PYTHONPATH=. python3 -m bench.probes.throughput_profile [--kv-bits 16] [--budgets 2048,8192]

For each token budget (max_num_batched_tokens): the 512 × 512 in / 128 out workload, every step timed
in its parts — schedule, prepare (host lists and copies), the forward's launches, the wait for the
sampled tokens (GPU time not yet done), postprocess and detokenize — and summed per step kind (pure
decode, mixed decode + prefill, prefill only). Then, with --profile, a few eager steps of each kind
under torch.profiler: kernel GPU time per step, grouped by kernel name.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[2])

import argparse
import collections
import gc
import json
import time
from pathlib import Path

import torch

from quantkit.engine.benchmark import BenchSetup, _random_prompts
from quantkit.engine.config import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_run(engine, prompts, params, profile_kinds=(), concurrency: int = 0) -> dict:
    """Step `engine` until every prompt is answered, timing each `Engine.step` in its parts. All prompts
    are queued at once (offline), or with `concurrency` > 0 a closed loop keeps that many requests in
    flight (a new one is queued the moment one finishes, as `bench serve`'s clients do, without HTTP).
    Per request: time to first token and mean time per output token after it."""
    rows = []
    runner, sched = engine.runner, engine.scheduler
    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    runner.prepare = timed("prepare", runner.prepare)
    runner.run = timed("run", runner.run)
    engine._sample = timed("sample", engine._sample)
    sched.schedule = timed("schedule", sched.schedule)
    queue = list(prompts)
    added, first, last, count = {}, {}, {}, collections.Counter()

    def feed() -> None:
        while queue and (concurrency <= 0 or len(engine._requests) < concurrency):
            rid = engine.add_request(queue.pop(0), params)
            added[rid] = time.perf_counter()

    profiles = {}
    _sync()
    start = time.perf_counter()
    feed()
    while engine.has_unfinished_requests():
        spent.clear()
        batch_kinds = {}

        def peek(fn=sched.schedule):
            batch = fn()
            nd = sum(1 for _, n in batch if n == 1)
            batch_kinds.update(nd=nd, ntok=batch.num_tokens, nseq=len(batch),
                               kind="decode" if nd == len(batch) else ("mixed" if nd else "prefill"))
            return batch

        sched.schedule = peek
        prof = None
        if profile_kinds and len(rows) > 8 and any(profiles.get(k, 0) < 5 for k in profile_kinds):
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        sched.schedule = peek.__defaults__[0]
        if prof is not None:
            _sync()
            prof.stop()
            kind = batch_kinds["kind"]
            if kind in profile_kinds and profiles.get(kind, 0) < 5:
                profiles[kind] = profiles.get(kind, 0) + 1
                profiles.setdefault(kind + "_events", []).append(prof.key_averages())
        for out in outputs:
            if out.token_ids:
                first.setdefault(out.request_id, t1)
                last[out.request_id] = t1
                count[out.request_id] += len(out.token_ids)
        rows.append(dict(**batch_kinds, schedule=spent["schedule"], prepare=spent["prepare"],
                         launch=spent["run"] - spent["prepare"], wait=spent["sample"],
                         post=(t1 - t0) - spent["schedule"] - spent["run"] - spent["sample"], total=t1 - t0))
        feed()
    _sync()
    elapsed = time.perf_counter() - start
    ttft = [first[r] - added[r] for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return dict(rows=rows, elapsed=elapsed, profiles=profiles, output_tokens=sum(count.values()),
                mean_ttft_ms=1e3 * sum(ttft) / max(len(ttft), 1), mean_tpot_ms=1e3 * sum(tpot) / max(len(tpot), 1))


def summarize(result: dict, label: str) -> None:
    rows = result["rows"]
    print(f"== {label}: {result['elapsed']:.2f} s, {len(rows)} steps")
    by = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        c = by[r["kind"]]
        c["steps"] += 1
        for k in ("ntok", "nd", "schedule", "prepare", "launch", "wait", "post", "total"):
            c[k] += r[k]
    for kind, c in by.items():
        n = c["steps"]
        print(f"  {kind:8s} steps {n:5d}  total {c['total']:7.2f} s  per step {1e3 * c['total'] / n:7.2f} ms "
              f"(sched {1e3 * c['schedule'] / n:.2f}, prepare {1e3 * c['prepare'] / n:.2f}, launch "
              f"{1e3 * c['launch'] / n:.2f}, wait {1e3 * c['wait'] / n:.2f}, post {1e3 * c['post'] / n:.2f})  "
              f"tokens/step {c['ntok'] / n:.0f}, decodes/step {c['nd'] / n:.0f}")
    # decode steps by batch size
    dec = collections.defaultdict(list)
    for r in rows:
        if r["kind"] == "decode":
            dec[r["nd"]].append(r["total"])
    sizes = sorted(dec)
    if sizes:
        picks = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
        print("  decode step ms by batch: " + ", ".join(
            f"{b}: {1e3 * sum(dec[b]) / len(dec[b]):.2f} (×{len(dec[b])})" for b in picks))
    for kind in ("decode", "mixed", "prefill"):
        events = result["profiles"].get(kind + "_events")
        if not events:
            continue
        merged = collections.Counter()
        counts = collections.Counter()
        for ev in events:
            for e in ev:
                if e.device_time_total > 0:
                    merged[e.key] += e.device_time_total
                    counts[e.key] += e.count
        steps = len(events)
        total = sum(merged.values()) / steps
        print(f"  -- {kind} (eager) kernels' GPU time per step {total / 1e3:.2f} ms over {steps} steps")
        for key, t in merged.most_common(14):
            print(f"     {t / steps:9.1f} µs {counts[key] // steps:5d}×  {100 * t / steps / total:5.1f} %  {key[:80]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--weights", default="w4", help="comma-separated: w4,fp16 runs both in one call")
    ap.add_argument("--kv-bits", type=int, default=16)
    ap.add_argument("--budgets", default="2048")
    ap.add_argument("--num-prompts", type=int, default=512, help="offline runs' prompts")
    ap.add_argument("--concurrency", default="0",
                    help="comma-separated levels; 0 = offline (every prompt at once), C > 0 = a closed loop of C "
                         "requests in flight, max(4 × C, 16) requests, as `bench serve` sends them")
    ap.add_argument("--graph-max-tokens", default="2048",
                    help="comma-separated: piecewise prefill graphs up to this many tokens (0: eager), one engine each")
    ap.add_argument("--passes", type=int, default=1, help="runs per level (the first meets first-seen shapes)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (a smoke run)")
    ap.add_argument("--profile", action="store_true", help="also profile eager steps (a separate engine)")
    ap.add_argument("--out", help="write each run's summary as JSON here")
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    for weights in args.weights.split(","):
        setup = BenchSetup(args.shape, weights, args.kv_bits, tiny=args.tiny)
        for budget, pieces in [(int(b), int(g)) for b in args.budgets.split(",")
                               for g in args.graph_max_tokens.split(",")]:
            for graphs in ([True, False] if args.profile else [True]):
                offline = levels == [0]
                engine = setup.engine(max_num_seqs=512 if offline else 256, cuda_graphs=graphs,
                                      max_model_len=args.input_len + args.output_len + 1 if offline else None,
                                      max_num_batched_tokens=budget, graph_max_tokens=pieces)
                vocab = engine.model.config.vocab_size
                print(f"KV pool: {engine.runner.num_blocks * engine.config.block_size} tokens", flush=True)
                for level in levels:
                    n = args.num_prompts if level == 0 else max(4 * level, 16)
                    for p in range(args.passes):
                        prompts = _random_prompts(n, args.input_len, vocab, seed=100 * level + p)
                        kinds = (("decode", "mixed", "prefill") if not graphs and torch.cuda.is_available()
                                 and p == args.passes - 1 else ())
                        result = timed_run(engine, prompts, params, kinds, concurrency=level)
                        out = result["output_tokens"] / result["elapsed"]
                        label = (f"{setup.describe()['shape']} {weights} kv{args.kv_bits} budget {budget} "
                                 f"graphs {graphs} pieces {pieces} "
                                 f"{'offline' if level == 0 else f'c{level}'} pass {p + 1}: {out:.0f} output tok/s, "
                                 f"mean TTFT {result['mean_ttft_ms']:.1f} ms, "
                                 f"mean TPOT {result['mean_tpot_ms']:.2f} ms")
                        summarize(result, label)
                        results.append(dict(shape=args.shape, weights=weights, budget=budget, graphs=graphs,
                                            pieces=pieces, concurrency=level, pass_=p + 1, output_tok_s=round(out, 1),
                                            mean_ttft_ms=round(result["mean_ttft_ms"], 2),
                                            mean_tpot_ms=round(result["mean_tpot_ms"], 3),
                                            steps=by_kind(result["rows"])))
                del engine
                gc.collect()  # the timing wrappers make cycles: free this engine's KV pool before the next one's
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def by_kind(rows: list[dict]) -> dict:
    """Per step kind: the count, mean tokens and decodes per step, and mean milliseconds of each part."""
    sums: dict[str, collections.Counter] = {}
    for r in rows:
        c = sums.setdefault(r["kind"], collections.Counter())
        c["steps"] += 1
        for k in ("ntok", "nd", "schedule", "prepare", "launch", "wait", "post", "total"):
            c[k] += r[k]
    out = {}
    for kind, c in sums.items():
        n = c["steps"]
        out[kind] = {"steps": n, "ntok": round(c["ntok"] / n, 1), "nd": round(c["nd"] / n, 1),
                     **{k: round(1e3 * c[k] / n, 3) for k in ("schedule", "prepare", "launch", "wait", "post", "total")}}
    return out


if __name__ == "__main__":
    main()
