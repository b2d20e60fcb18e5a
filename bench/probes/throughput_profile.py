"""Where the engine's offline throughput run (`bench throughput`) spends its time, step by step.

    PYTHONPATH=. python3 -m bench.probes.throughput_profile [--kv-bits 16] [--budgets 2048,8192]

For each token budget (max_num_batched_tokens): the 512 × 512 in / 128 out workload, every step timed
in its parts — schedule, prepare (host lists and copies), the forward's launches, the wait for the
sampled tokens (GPU time not yet done), postprocess and detokenize — and summed per step kind (pure
decode, mixed decode + prefill, prefill only). Then, with --profile, a few eager steps of each kind
under torch.profiler: kernel GPU time per step, grouped by kernel name.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from quantkit.engine.benchmark import BenchSetup, _random_prompts
from quantkit.engine.config import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_run(engine, prompts, params, profile_kinds=()) -> dict:
    rows = []
    runner, sched = engine.runner, engine.scheduler
    prepare = runner.prepare
    spent = {"prepare": 0.0}

    def timed_prepare(batch):
        t = time.perf_counter()
        out = prepare(batch)
        spent["prepare"] += time.perf_counter() - t
        return out

    runner.prepare = timed_prepare
    for p in prompts:
        engine.add_request(p, params)
    profiles = {}
    _sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        spent["prepare"] = 0.0
        nd = sum(1 for _, n in batch if n == 1)
        ntok = batch.num_tokens
        kind = "decode" if nd == len(batch) else ("mixed" if nd else "prefill")
        prof = None
        if kind in profile_kinds and profiles.get(kind, 0) < 5 and rows and len(rows) > 8:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        logits, seqs = runner.run(batch)
        t2 = time.perf_counter()
        token_ids, logprobs = engine.sampler(logits, seqs) if seqs else (torch.empty(0), None)
        token_ids = token_ids.tolist()
        t3 = time.perf_counter()
        if prof is not None:
            prof.stop()
            profiles[kind] = profiles.get(kind, 0) + 1
            profiles.setdefault(kind + "_events", []).append(prof.key_averages())
        sched.postprocess(batch, token_ids, logprobs)
        for seq, tok in zip(seqs, token_ids):
            engine._advance(seq, tok)
        t4 = time.perf_counter()
        rows.append(dict(kind=kind, nd=nd, ntok=ntok, nseq=len(batch), schedule=t1 - t0, prepare=spent["prepare"],
                         launch=t2 - t1 - spent["prepare"], wait=t3 - t2, post=t4 - t3, total=t4 - t0))
    _sync()
    elapsed = time.perf_counter() - start
    return dict(rows=rows, elapsed=elapsed, profiles=profiles)


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
    ap.add_argument("--weights", default="w4")
    ap.add_argument("--kv-bits", type=int, default=16)
    ap.add_argument("--budgets", default="2048")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (a smoke run)")
    ap.add_argument("--profile", action="store_true", help="also profile eager steps (a separate engine)")
    args = ap.parse_args()
    setup = BenchSetup(args.shape, args.weights, args.kv_bits, tiny=args.tiny)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for budget in [int(b) for b in args.budgets.split(",")]:
        for graphs in ([True, False] if args.profile else [True]):
            engine = setup.engine(max_model_len=args.input_len + args.output_len + 1, cuda_graphs=graphs,
                                  max_num_batched_tokens=budget)
            vocab = engine.model.config.vocab_size
            engine.generate(_random_prompts(4, args.input_len, vocab, seed=1), params, progress=False)
            prompts = _random_prompts(args.num_prompts, args.input_len, vocab)
            kinds = ("decode", "mixed", "prefill") if not graphs and torch.cuda.is_available() else ()
            result = timed_run(engine, prompts, params, kinds)
            out = len(result["rows"]) and args.num_prompts * args.output_len / result["elapsed"]
            summarize(result, f"{args.shape} {args.weights} kv{args.kv_bits} budget {budget} graphs {graphs}: "
                              f"{out:.0f} output tok/s")
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
