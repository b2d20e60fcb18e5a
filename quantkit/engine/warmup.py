"""Warm-up traffic: before an engine serves, synthetic requests run through it so that the kernels every later
step can meet are compiled (or loaded from the compile cache) at start, not in a user's time to first token.

The start-up forwards (model_runner: prefills at the token-count bounds, the decode and piecewise graphs) cover
pure steps. What they do not meet are the steps of a serving engine: decodes batched with a prefill chunk (the
eager decode attention at every decode count, whose partition count and table width Triton specializes on),
prefills over a cached prefix (chunked prompts, prefix-cache hits), the sampler's paths, asynchronous
scheduling's device-side inputs. The traffic adds one request whenever the last one's prompt is in, while the earlier ones decode,
so the mixed steps carry 1, 2 … `width` decodes beside prompts of lengths around every 16-token bound and block-table
width; one prompt longer than a step's budget is chunked, one is sent twice for a prefix hit. Afterwards the
prefix cache and the counters are reset: the traffic leaves nothing a user can see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quantkit.engine.config import SamplingParams

# Prompt lengths cycled through: both sides of the 16-token specializations and of block-table widths 1, 16, 17.
PROMPT_LENGTHS = (1, 2, 15, 16, 17, 33, 100, 255, 256, 257, 300, 511)
WIDTH = 80   # most decodes batched beside a prefill: past the point where the decode attention stops splitting


@dataclass
class WarmupReport:
    requests: int
    steps: int
    seconds: float


def traffic(max_num_seqs: int, budget: int, max_model_len: int, pool_tokens: int,
            width: int = WIDTH) -> list[tuple[int, int]]:
    """(prompt length, max_tokens) per request, in the order they are added (each once the one before it has been
    prefilled). Each request decodes until every later one has been prefilled (a long prompt takes several steps'
    budgets), so the prefills meet every decode count from 1 up to the number of requests − 1; the whole fits half
    the pool (no preemption)."""
    width = max(1, min(width, max_num_seqs - 1))
    per_step = max(1, budget - width)            # prompt tokens a step has room for beside the decodes
    lengths: list[int] = []
    used = 0
    for i in range(width + 1):
        length = max(1, min(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], max_model_len // 2))
        if used + length > pool_tokens // 4:
            break
        lengths.append(length)
        used += length
    steps = [-(-n // per_step) for n in lengths]   # the steps each prompt's prefill takes
    plan = []
    for i, length in enumerate(lengths):
        new = min(sum(steps[i + 1:]) + 2, max_model_len - length - 1)
        plan.append((length, new))
    while plan and sum(n + new for n, new in plan) > pool_tokens // 2:
        plan.pop()
    used = sum(n + new for n, new in plan)
    long = min(2 * budget + 5, max_model_len - 3, pool_tokens // 4)
    if long > budget and used + 2 * long + 4 <= pool_tokens // 2:  # chunked, then the same prompt again: a prefix hit
        plan += [(long, 2), (long, 2)]
    return plan


@torch.no_grad()
def warm_up(engine, width: int = WIDTH, seed: int = 0) -> WarmupReport:
    """Run the warm-up traffic through `engine` (an Engine with no requests of its own) and reset what it left:
    the prefix cache's keys and the counters of `Engine.stats`."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs on an idle engine: it has requests")
    start = time.perf_counter()
    config = engine.config
    pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    plan = traffic(config.max_num_seqs, config.max_num_batched_tokens, engine.max_model_len, pool_tokens, width)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n, _ in plan]
    if len(plan) >= 2 and plan[-1] == plan[-2]:
        prompts[-1] = prompts[-2]
    pending = list(zip(prompts, plan))
    ids, steps = [], 0
    sched = engine.scheduler
    while pending or engine.has_unfinished_requests():
        # The next request once the last one's prompt is in: each prefill then meets one more decode.
        if pending and not sched.waiting and all(s.num_uncomputed_tokens <= 1 for s in sched.running):
            prompt, (_, new) = pending.pop(0)
            sampled = len(ids) % 2  # greedy and sampled rows, the sampler's two paths
            params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                    top_p=0.9 if sampled else 1.0, seed=len(ids) if sampled else None)
            ids.append(engine.add_request(prompt, params, request_id=f"warm-up-{len(ids)}"))
        engine.step()
        steps += 1
    engine.reset_after_warm_up()
    return WarmupReport(len(ids), steps, time.perf_counter() - start)
