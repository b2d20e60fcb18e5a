"""Engine speed on random-weight models of real shapes: batch-1 decode latency and offline throughput.

Speed does not depend on the weights' values, so the model is built straight on the device from a
config with random weights (4-bit group-128 packed codes for "w4"): no checkpoint to download or write.
`--tiny` runs a small shape on the CPU, which is how the tests smoke the benchmarks themselves.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from quantkit.config import UserError
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.llm_engine import Engine
from quantkit.engine.random_model import SHAPES, build_random_model


@dataclass(frozen=True)
class BenchSetup:
    shape: str = "llama2-7b"
    weights: str = "w4"              # "w4" (4-bit, group 128), "w8" (8-bit per channel) or "fp16"
    kv_bits: int = 16
    tiny: bool = False               # the "tiny" shape on the CPU
    cache_max_entry_count: float = 0.8

    def engine(self, max_num_seqs: int = 256, max_model_len: Optional[int] = None, cuda_graphs: bool = True,
               **overrides: object) -> Engine:
        """An engine over a fresh random model of this shape; `overrides` set other EngineConfig fields."""
        shape = "tiny" if self.tiny else self.shape
        if shape not in SHAPES:
            raise UserError(f"unknown shape {shape!r}: use one of {', '.join(s for s in SHAPES if s != 'tiny')}")
        device = "cpu" if self.tiny else "cuda"
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("the benchmarks need a CUDA GPU: use --tiny for the CPU smoke run")
        dtype = torch.float32 if self.tiny else torch.float16
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        model = build_random_model(shape, self.weights, torch.device(device), dtype)
        overrides = {"num_kv_tokens": 16384 if self.tiny else None, **overrides}
        config = EngineConfig(kv_bits=self.kv_bits, cache_max_entry_count=self.cache_max_entry_count,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device, dtype=dtype,
                              cuda_graphs=cuda_graphs, **overrides)
        return Engine.from_model(model, None, config)

    def describe(self) -> dict:
        return {"shape": "tiny" if self.tiny else self.shape, "weights": self.weights, "kv_bits": self.kv_bits}


def _random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def _peak_gib(engine: Engine) -> Optional[float]:
    if engine.runner.device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(engine.runner.device) / 2**30, 2)


def latency(setup: BenchSetup, prompt_len: int = 32, output_len: int = 256, runs: int = 3) -> dict:
    """Batch-1 decode tokens/s: the time from the first new token to the last, over output_len − 1
    tokens (the prompt's prefill excluded; reported apart as time to first token). Best of `runs`,
    after one warm-up run."""
    engine = setup.engine(max_num_seqs=1, max_model_len=prompt_len + output_len + 1)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    best_decode, best_ttft = float("inf"), float("inf")
    for attempt in range(runs + 1):
        prompt = _random_prompts(1, prompt_len, engine.model.config.vocab_size, seed=attempt)[0]
        _sync(engine)
        start = time.perf_counter()
        stamps = []
        for out in engine.stream(prompt, params):
            stamps.extend([time.perf_counter()] * len(out.token_ids))  # the token is on the host: step synced
        if len(stamps) != output_len:
            raise RuntimeError(f"expected {output_len} tokens, got {len(stamps)}")
        if attempt:  # the first attempt warms up (kernels compiled; graphs were captured at start)
            best_decode = min(best_decode, stamps[-1] - stamps[0])
            best_ttft = min(best_ttft, stamps[0] - start)
    return {"bench": "latency", **setup.describe(), "input_len": prompt_len, "output_len": output_len,
            "decode_tok_s": round((output_len - 1) / best_decode, 1), "ttft_ms": round(best_ttft * 1e3, 2),
            "cuda_graphs": bool(engine.runner.graphs), "peak_gib": _peak_gib(engine)}


def throughput(setup: BenchSetup, num_prompts: int = 512, input_len: int = 512, output_len: int = 128,
               max_num_seqs: int = 512, max_num_batched_tokens: int = 8192) -> dict:
    """vLLM's benchmark_throughput: every request submitted at once, fixed lengths (EOS ignored);
    output tokens/s and all tokens/s over the wall time of the whole batch. The engine runs up to
    `max_num_seqs` sequences and `max_num_batched_tokens` tokens per step: offline, larger than the
    serving defaults (256, 2048), as vLLM's offline engine also takes."""
    engine = setup.engine(max_num_seqs=max_num_seqs, max_model_len=input_len + output_len + 1,
                          max_num_batched_tokens=max_num_batched_tokens)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(_random_prompts(min(num_prompts, 4), input_len, vocab, seed=1), params, progress=False)  # warm-up
    prompts = _random_prompts(num_prompts, input_len, vocab)
    _sync(engine)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, progress=False)
    _sync(engine)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {"bench": "throughput", **setup.describe(), "num_prompts": num_prompts, "input_len": input_len,
            "output_len": output_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "preemptions": engine.scheduler.num_preemptions, "output_tok_s": round(produced / elapsed, 1),
            "total_tok_s": round((produced + num_prompts * input_len) / elapsed, 1), "seconds": round(elapsed, 2),
            "kv_pool_tokens": engine.runner.num_blocks * engine.config.block_size, "peak_gib": _peak_gib(engine)}


def capacity(setup: BenchSetup) -> dict:
    """How many tokens the KV pool holds at the setup's cache_max_entry_count (lmdeploy's sizing rule:
    a fraction of the memory left after the weights and a warm-up step), and its size."""
    engine = setup.engine(cuda_graphs=False)
    tokens = engine.runner.num_blocks * engine.config.block_size
    return {"bench": "capacity", **setup.describe(), "cache_max_entry_count": setup.cache_max_entry_count,
            "kv_pool_tokens": tokens, "kv_pool_gib": round(tokens * engine.runner.bytes_per_token() / 2**30, 2),
            "peak_gib": _peak_gib(engine)}


def long_context(setup: BenchSetup, batch: int, context: int, output_len: int = 64) -> dict:
    """Decode tokens/s of `batch` sequences whose prompts hold `context` tokens: the prompts are prefilled
    first (not timed), then every step decodes one token for each sequence; the time from the step after
    the last first token to the last step."""
    engine = setup.engine(max_num_seqs=batch, max_model_len=context + output_len + 1)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for prompt in _random_prompts(batch, context, engine.model.config.vocab_size):
        engine.add_request(prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked under the token budget) until every sequence has a token
        started.update(out.request_id for out in engine.step() if out.token_ids)
    _sync(engine)
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(out.token_ids) for out in engine.step())
    _sync(engine)
    elapsed = time.perf_counter() - start
    return {"bench": "long_context", **setup.describe(), "batch": batch, "context": context,
            "decode_tok_s": round(produced / elapsed, 1), "decoded": produced,
            "kv_pool_tokens": engine.runner.num_blocks * engine.config.block_size, "peak_gib": _peak_gib(engine)}


def print_rows(rows: list[dict]) -> None:
    """A plain table: one column per key of the first row."""
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def run_grid(measure: Callable[[BenchSetup], dict], shapes: list[str], weights: list[str], kv_bits: list[int],
             tiny: bool = False, cache_max_entry_count: float = 0.8, out: Optional[str] = None) -> list[dict]:
    """`measure` on every shape × weights × KV-bits combination, one engine at a time (freed before the
    next): each row printed as JSON as it comes, then the table; the rows written to `out` as JSON."""
    rows = []
    for shape, w, bits in itertools.product(["tiny"] if tiny else shapes, weights, kv_bits):
        rows.append(measure(BenchSetup(shape, w, bits, tiny, cache_max_entry_count)))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if torch.cuda.is_available() and not tiny:
        print(torch.cuda.get_device_name())
    print_rows(rows)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows
