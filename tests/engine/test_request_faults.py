"""One request's fault is that request's alone: a request whose sampling or detokenizing raises ends with
finish_reason "error" and frees its blocks while the others in the same steps get exactly the tokens they
get alone; a request that cannot be added leaves nothing behind. (A step that fails as a whole reaches every
request the server's step loop holds: tests/server/test_engine_loop.py.)"""

from __future__ import annotations

import pytest
import torch
from quantkit_testing.tiny import poison_sampler

from quantkit.engine import Engine, EngineConfig, SamplingParams, llm_engine
from quantkit.engine.llm_engine import RequestFailed

POISON_SEED = 13


def params(seed: int, n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 20, 33)]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def eng(tiny_models, request) -> Engine:
    """Both ways of stepping: each step's tokens read back before the next, or asynchronous scheduling."""
    return Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=1024, async_scheduling=request.param))


def run_all(eng: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, object]:
    ids = [eng.add_request(p, sp) for p, sp in requests]
    final, tokens = {}, {i: [] for i in ids}
    for _ in range(200):
        if len(final) == len(ids):
            break
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                final[out.request_id] = out
    assert len(final) == len(ids), "the requests did not finish"
    return {i: (final[i], tokens[i]) for i in ids}


def test_a_request_whose_sampling_fails_ends_alone(eng):
    good = [(p, params(seed)) for p, seed in zip(prompts(), (1, 2, 3))]
    alone = [toks for _, toks in run_all(eng, good).values()]
    poison_sampler(eng, POISON_SEED, OverflowError("Overflow when unpacking long long"))
    mixed = good[:2] + [(prompts()[0], params(POISON_SEED))] + good[2:]
    results = list(run_all(eng, mixed).values())
    bad_out, bad_tokens = results[2]
    assert bad_out.finish_reason == "error" and "OverflowError" in bad_out.error and bad_tokens == []
    # The others were sampled each with its own seed, in the same steps: the same tokens as alone.
    assert [toks for _, toks in results[:2] + results[3:]] == alone
    assert all(out.finish_reason == "length" for out, _ in results[:2] + results[3:])
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_request_whose_detokenizer_fails_ends_alone(eng):
    ids = [eng.add_request(p, params(seed)) for p, seed in zip(prompts(), (1, 2, 3))]
    victim = eng._requests[ids[1]].detok
    steps = {"n": 0}
    step = victim.step

    def fails_on_third(token_id):
        steps["n"] += 1
        if steps["n"] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return step(token_id)

    victim.step = fails_on_third
    outs: dict[str, list] = {i: [] for i in ids}
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outs[out.request_id].append(out)
    assert outs[ids[1]][-1].finish_reason == "error" and "UnicodeDecodeError" in outs[ids[1]][-1].error
    assert sum(len(o.token_ids) for o in outs[ids[1]]) == 2       # the two tokens before the failure
    assert [outs[i][-1].finish_reason for i in (ids[0], ids[2])] == ["length", "length"]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_request_that_cannot_be_added_leaves_nothing_behind(eng, monkeypatch):
    class Broken:
        def __init__(self, *args):
            raise RuntimeError("tokenizer state lost")

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", Broken)
    with pytest.raises(RuntimeError):
        eng.add_request(prompts()[0], params(1))
    assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    monkeypatch.undo()
    out = eng.generate([prompts()[1]], params(1), progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_stream_raises_for_its_failed_request(eng):
    poison_sampler(eng, POISON_SEED, ValueError("bad settings"))
    with pytest.raises(RequestFailed, match="bad settings"):
        list(eng.stream(prompts()[0], params(POISON_SEED)))
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
