"""Asynchronous scheduling (EngineConfig.async_scheduling): step N+1 is scheduled and launched before step N's
tokens are read back, its inputs taken from step N's sampled tokens on the device. On the CPU nothing runs
behind the host, but every path is the GPU's: these tests check that requests get exactly the tokens, text,
finish reasons and usage of the synchronous engine, that a stop token costs one dropped step at most and
max_tokens none, and that aborts, preemption and the requests that need their tokens on the host still work."""

from __future__ import annotations

import pytest
import torch

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.sequence import PENDING

from tests.engine.test_engine import GREEDY, hf_greedy, prompts, run_staggered


def engine(path, overlap: bool, **settings) -> Engine:
    return Engine(path, EngineConfig(device="cpu", async_scheduling=overlap, **{"num_kv_tokens": 2048, **settings}))


def summary(out) -> tuple:
    return (out.token_ids, out.text, out.finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens)


def record_scheduled(eng: Engine) -> dict[str, int]:
    """Count the steps each request is scheduled in (the runner's batches)."""
    counts: dict[str, int] = {}
    run = eng.runner.run

    def counting(batch, previous=None):
        for seq, _ in batch:
            counts[seq.request_id] = counts.get(seq.request_id, 0) + 1
        return run(batch, previous)

    eng.runner.run = counting
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hf_with_staggered_arrivals_chunks_and_preemption(tiny_models, arch):
    path = tiny_models[arch]
    ps = prompts(1)
    eng = engine(path, True, max_num_batched_tokens=24)
    for prompt, toks in run_staggered(eng, [ps[:2], ps[2:4], ps[4:]]).values():
        assert toks == hf_greedy(path, prompt)
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks
    # 160 tokens of pool for four sequences ending at 44–62 tokens: preempted while their last token was on
    # its way back, readmitted only once it was.
    small = engine(path, True, num_kv_tokens=160, enable_prefix_caching=False)
    qs = prompts(2, (20, 30, 12, 25))
    outs = small.generate(qs, GREEDY, progress=False)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_greedy(path, q) for q in qs]
    assert small.block_manager.num_free_blocks == small.runner.num_blocks


def test_same_outputs_as_the_synchronous_engine(tiny_models):
    """Seeded sampling, greedy, stop tokens, stop strings and max_tokens in one batch: the same tokens, text,
    finish and stop reasons, and usage, whichever way the engine steps."""
    path = tiny_models["llama"]
    sync = engine(path, False)
    probe = sync.generate(["the cache keeps"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                          progress=False)[0]
    # The greedy requests continue the probe's prompt, so its 6th token and a piece of its text stop them.
    ps = ["weights are packed", "the cache keeps", [5, 6, 7, 8, 9], "the cache keeps"]
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[probe.token_ids[5]]),
              SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[probe.text[4:7]])]
    expected = [summary(o) for o in sync.generate(ps, params, progress=False)]
    assert [e[2] for e in expected] == ["length", "stop", "length", "stop"]
    got = [summary(o) for o in engine(path, True).generate(ps, params, progress=False)]
    assert got == expected
    # Streaming: the deltas add up to the same whole answers.
    eng = engine(path, True)
    for p, sp, e in zip(ps, params, expected):
        deltas = list(eng.stream(p, sp))
        assert (sum((d.token_ids for d in deltas), []), "".join(d.text for d in deltas)) == e[:2]
        assert [d.finished for d in deltas][-1] and deltas[-1].finish_reason == e[2]


def test_one_step_late_and_at_most_one_dropped_step(tiny_models):
    path = tiny_models["llama"]
    eng = engine(path, True)
    counts = record_scheduled(eng)
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert eng.step() == []                    # the prefill is launched; its token is still on its way
    seq = eng._requests[rid].seq
    assert seq.token_ids[-1] == PENDING and seq.has_pending
    outs = eng.step()                          # the first decode is launched, the prefill's token read back
    assert [o.token_ids for o in outs] == [[seq.token_ids[3]]] and seq.token_ids[3] != PENDING
    while eng.has_unfinished_requests():
        eng.step()
    assert counts[rid] == 4                    # max_tokens is known on the host: no step is dropped
    # A stop token is known only when read back: one step computed past it, dropped.
    greedy = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                          progress=False)[0].token_ids
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])   # its first new token
    counts.clear()
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[greedy[k]]), progress=False)[0]
    assert out.token_ids == greedy[:k + 1] and out.finish_reason == "stop"
    (count,) = counts.values()
    assert count == k + 2                      # k + 1 tokens, plus the step after the stop token
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_abort_while_the_step_is_in_flight(tiny_models):
    path = tiny_models["llama"]
    eng = engine(path, True, enable_prefix_caching=False)
    ps = prompts(5, (10, 12))
    a = eng.add_request(ps[0], GREEDY)
    b = eng.add_request(ps[1], GREEDY)
    assert eng.step() == []
    toks = {o.request_id: o.token_ids for o in eng.step()}[b]   # the prefills' tokens
    eng.abort(a)                               # its token of the step in flight is never reported
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == b
            toks += out.token_ids
    assert toks == hf_greedy(path, ps[1])
    eng.step()                                 # nothing left but what is in flight: read back, nothing reported
    assert eng._inflight is None and eng.block_manager.num_free_blocks == eng.runner.num_blocks


@pytest.mark.parametrize("host_param", [dict(logprobs=2), dict(repetition_penalty=1.3),
                                        dict(frequency_penalty=0.5)], ids=["logprobs", "repetition", "frequency"])
def test_requests_that_sample_on_the_host_step_synchronously(tiny_models, host_param):
    """While a request whose sampling reads its tokens on the host runs, each step's tokens are read back
    before the next is scheduled: outputs come in the call that made them, and equal the synchronous
    engine's."""
    path = tiny_models["llama"]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **host_param),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)]
    ps = ["the cache keeps", [9, 8, 7, 6]]
    expected = [summary(o) for o in engine(path, False).generate(ps, params, progress=False)]
    eng = engine(path, True)
    rid = eng.add_request(ps[0], params[0])
    assert [o.request_id for o in eng.step()] == [rid]   # not one step late
    eng.abort(rid)
    got = eng.generate(ps, params, progress=False)
    assert [summary(o) for o in got] == expected
    if "logprobs" in host_param:
        assert [lp.token_id for lp in got[0].logprobs] == got[0].token_ids


def test_pending_is_never_a_model_input(tiny_models):
    """The inputs of a step whose sequences' last tokens are PENDING are the sampled ids, taken on the device."""
    path = tiny_models["llama"]
    eng = engine(path, True)
    seen = []
    prepare = eng.runner.prepare

    def checking(batch, previous=None):
        step = prepare(batch, previous)
        seen.append(step.input_ids.clone())
        return step

    eng.runner.prepare = checking
    eng.generate(prompts(6, (4, 9, 15)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                 progress=False)
    ids = torch.cat(seen)
    assert len(seen) > 5 and bool((ids >= 0).all())
