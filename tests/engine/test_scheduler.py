"""Scheduler against a fake model that reads its context back from a simulated paged KV pool: every token it
sees must have been written to the slot the block table names, so wrong block tables, prefix hits, chunk
bounds or preemption bookkeeping change the tokens generated."""

from __future__ import annotations

import random

import pytest

from quantkit.config import UserError
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.scheduler import Scheduler
from quantkit.engine.sequence import Sequence

VOCAB = 97


def next_token(context: list[int]) -> int:
    """The fake model: a token that depends on every token of the context and its order."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens one sequence gets alone, with no cache at all."""
    tokens, out = list(prompt), []
    while len(out) < params.max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids:
            break
    return out


class FakeModel:
    """Writes each scheduled token into its slot, reads every sampled sequence's context from the slots."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.bs = block_manager.block_size
        self.pool: list = [None] * (block_manager.num_blocks * self.bs)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, batch) -> list[int]:
        for seq, n in batch:
            assert 0 < n and seq.num_computed_tokens + n <= len(seq)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.pool[self.slot(seq, pos)] = seq.token_ids[pos]
        tokens = []
        for seq in batch.sampled:
            context = [self.pool[self.slot(seq, pos)] for pos in range(len(seq))]
            assert context == seq.token_ids, f"{seq}: cache holds {context}"
            tokens.append(next_token(context))
        return tokens


def finish_step(scheduler: Scheduler, batch, token_ids: list[int]) -> None:
    """What Engine.step does after the forward: count the step's tokens, then append each sampled token."""
    sampled = batch.sampled
    assert len(token_ids) == len(sampled)
    scheduler.account(batch)
    for seq, token_id in zip(sampled, token_ids):
        scheduler.append(seq, token_id)


class Stats:
    steps = preempted = prefix_hits = chunked = 0


def drive(scheduler: Scheduler, arrivals: dict[int, list[Sequence]], model: FakeModel = None,
          max_steps: int = 2000) -> Stats:
    """Run steps until every sequence finished, checking each batch against the config's limits."""
    config, stats = scheduler.config, Stats()
    model = model or FakeModel(scheduler.block_manager)
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        if not scheduler.has_unfinished() and step > max(arrivals):
            break
        decoders = [s for s in scheduler.running if s.num_uncomputed_tokens == 1]
        waiting = list(scheduler.waiting)
        batch = scheduler.schedule()
        assert batch.num_tokens <= config.max_num_batched_tokens and len(batch) <= config.max_num_seqs
        scheduled = [s for s, _ in batch]
        assert len(set(map(id, scheduled))) == len(scheduled)
        # Decodes come first: the decoders scheduled are a prefix of the batch.
        flags = [any(s is d for d in decoders) for s in scheduled]
        assert flags == sorted(flags, reverse=True)
        stats.prefix_hits += sum(1 for s in scheduled if any(s is w for w in waiting) and s.num_computed_tokens > 0)
        stats.chunked += sum(1 for s, n in batch if n < s.num_uncomputed_tokens)
        stats.steps += 1
        finish_step(scheduler, batch, model.run(batch))
    else:
        raise AssertionError("did not finish")
    stats.preempted = scheduler.num_preemptions
    return stats


def make_scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    return Scheduler(EngineConfig(block_size=block_size, **config), BlockManager(num_blocks, block_size))


def assert_pool_empty(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert [b.ref_count for b in bm.blocks] == [0] * bm.num_blocks and bm.num_free_blocks == bm.num_blocks
    assert not scheduler.running and not scheduler.waiting


def test_continuous_batching_with_preemption_prefix_hits_and_chunks_matches_each_alone():
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(9)]    # a shared system prompt: prefix hits
    arrivals: dict[int, list[Sequence]] = {}
    expected = {}
    for i in range(14):
        prompt = (system if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(max_tokens=rng.randint(4, 12))
        seq = Sequence(prompt, params, request_id=f"r{i}")
        arrivals.setdefault(rng.choice([0, 0, 1, 3, 6, 10]), []).append(seq)
        expected[seq.request_id] = (seq, reference(prompt, seq.params))
    # 12 blocks of 4 tokens: four sequences of ~25 tokens cannot all stay; a 12-token budget chunks prompts.
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=12, max_num_seqs=4)
    stats = drive(scheduler, arrivals)
    for rid, (seq, tokens) in expected.items():
        assert seq.output_token_ids == tokens, rid
        assert seq.finish_reason == "length" and seq.is_finished
    assert stats.preempted > 0 and stats.prefix_hits > 0 and stats.chunked > 0
    assert_pool_empty(scheduler)


def test_chunked_prefill_respects_the_budget_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    short = Sequence([1, 2, 3], SamplingParams(max_tokens=20))
    scheduler.add(short)
    model = FakeModel(scheduler.block_manager)
    batch = scheduler.schedule()
    assert [(s, n) for s, n in batch] == [(short, 3)]
    finish_step(scheduler, batch, model.run(batch))
    long = Sequence(list(range(30)), SamplingParams(max_tokens=2))
    scheduler.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = scheduler.schedule()
        assert batch.items[0] == (short, 1)               # the decode first, every step
        chunks.append(batch.items[1][1])
        assert batch.num_tokens <= 8
        finish_step(scheduler, batch, model.run(batch))
    assert chunks == [7, 7, 7, 7, 2]                     # 30 prompt tokens in budget-sized pieces
    assert long.output_token_ids == [next_token(list(range(30)))]


def test_a_repeated_prompt_computes_only_its_uncached_tail():
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(1, 15))                          # 14 tokens: 3 full blocks
    first = Sequence(prompt, SamplingParams(max_tokens=3))
    model = FakeModel(scheduler.block_manager)
    drive(scheduler, {0: [first]}, model)
    second = Sequence(prompt, SamplingParams(max_tokens=3))
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.items == [(second, 2)] and second.num_computed_tokens == 12
    finish_step(scheduler, batch, model.run(batch))  # reads the first 12 tokens from first's blocks
    assert second.output_token_ids[:1] == first.output_token_ids[:1]


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=16)
    model = FakeModel(scheduler.block_manager)
    a = Sequence(list(range(10)), SamplingParams(max_tokens=50), request_id="a")
    b = Sequence(list(range(10)) + [5], SamplingParams(max_tokens=50), request_id="b")
    c = Sequence(list(range(60)), SamplingParams(max_tokens=50), request_id="c")  # cannot be admitted yet
    scheduler.add(a)
    batch = scheduler.schedule()
    finish_step(scheduler, batch, model.run(batch))
    scheduler.add(b)
    scheduler.add(c)
    batch = scheduler.schedule()
    finish_step(scheduler, batch, model.run(batch))
    assert scheduler.waiting[0] is c and b.block_table[:2] == a.block_table[:2]
    free = scheduler.block_manager.num_free_blocks
    assert scheduler.abort("a") is a
    assert a.finish_reason == "abort" and a.is_finished and not a.block_table
    assert scheduler.block_manager.num_free_blocks == free + 1          # a's shared blocks are still b's
    assert scheduler.abort("c") is c and not scheduler.waiting
    assert scheduler.abort("c") is None and scheduler.abort("nobody") is None
    batch = scheduler.schedule()
    assert [s for s, _ in batch] == [b]
    scheduler.abort("b")
    assert_pool_empty(scheduler)
    assert not scheduler.schedule()


def sequence_with(prompt_len: int, **params) -> Sequence:
    # With next_token from len(), the outputs are predictable: prompt_len, prompt_len + 1, ...
    return Sequence(list(range(prompt_len)), SamplingParams(**params).with_defaults(None))


def run_counting(seq: Sequence, num_blocks: int = 64, model_len=None, **config) -> Scheduler:
    scheduler = Scheduler(EngineConfig(block_size=4, **config), BlockManager(num_blocks, 4), max_model_len=model_len)
    scheduler.add(seq)
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        finish_step(scheduler, batch, [len(s) for s in batch.sampled])
    return scheduler


@pytest.mark.parametrize("params, tokens, reason, stop_reason", [
    (dict(eos_token_ids=[7], max_tokens=10), [5, 6, 7], "stop", None),
    (dict(eos_token_ids=[7], ignore_eos=True, max_tokens=4), [5, 6, 7, 8], "length", None),
    (dict(eos_token_ids=[7], ignore_eos=True, stop_token_ids=[6], max_tokens=10), [5, 6], "stop", 6),
    (dict(max_tokens=3), [5, 6, 7], "length", None),
])
def test_finish_on_stop_tokens_eos_and_max_tokens(params, tokens, reason, stop_reason):
    seq = sequence_with(5, **params)
    scheduler = run_counting(seq)
    assert seq.output_token_ids == tokens and seq.finish_reason == reason and seq.stop_reason == stop_reason
    assert_pool_empty(scheduler)


def test_a_sequence_stops_at_the_pool_or_max_model_len():
    seq = sequence_with(5, max_tokens=100)
    run_counting(seq, num_blocks=3)                      # 12 tokens fit: it ends there, alone, not in a loop
    assert len(seq) == 12 and seq.finish_reason == "length"
    seq = sequence_with(5, max_tokens=100)
    run_counting(seq, max_model_len=9)
    assert len(seq) == 9 and seq.finish_reason == "length"
    seq = sequence_with(5, max_tokens=100)
    run_counting(seq, model_len=10)                      # the model's own limit, when the config sets none
    assert len(seq) == 10 and seq.finish_reason == "length"


def test_a_prompt_the_pool_cannot_hold_is_refused():
    scheduler = make_scheduler(num_blocks=3)
    with pytest.raises(UserError, match="prompt has 12 tokens"):
        scheduler.add(Sequence(list(range(12))))


def test_a_stop_string_on_the_last_allowed_token_reports_stop():
    seq = sequence_with(5, max_tokens=2)
    scheduler = run_counting(seq)
    assert seq.finish_reason == "length"
    scheduler.finish(seq, "stop", "6")                   # the detokenizer found a stop string in that token's text
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "6")
    scheduler.finish(seq, "abort")
    assert seq.finish_reason == "stop"
    assert_pool_empty(scheduler)
