"""Sampler against direct computations, and SamplingParams' defaults from a generation config."""

from __future__ import annotations

import gc
import math
import random
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from quantkit.config import ConfigError
from quantkit.engine import Engine
from quantkit.engine import sampler as sampler_module
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.sampler import PenaltyTokens, Sampler, filter_logits
from quantkit.engine.sequence import Sequence, SequenceStatus

V = 40


def seq(prompt=(1, 2, 3), output=(), **params) -> Sequence:
    s = Sequence(list(prompt), SamplingParams(**params))
    for t in output:
        s.append_token(t)
    return s


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_in_a_mixed_batch():
    logits = random_logits(6)
    seqs = [seq(temperature=0.0) if i % 2 == 0 else seq(temperature=1.0, top_k=5) for i in range(6)]
    tokens, _ = Sampler()(logits, seqs)
    assert tokens[0::2].tolist() == logits.argmax(dim=1)[0::2].tolist()


def reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens that survive, computed the plain way: one row, python lists."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    kept = order[:top_k] if top_k else order
    z = sum(math.exp(row[i].item()) for i in kept)
    probs = {i: math.exp(row[i].item()) / z for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p and top_p < 1:
            break
        nucleus.append(i)
        mass += probs[i]
    top = probs[nucleus[0]]
    return {i for i in nucleus if probs[i] >= min_p * top}


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2),
                                                 (8, 0.7, 0.05), (3, 0.01, 0.0), (V + 5, 0.9, 0.5)])
def test_top_k_top_p_min_p_keep_what_a_direct_computation_keeps(top_k, top_p, min_p):
    logits = random_logits(8, seed=top_k)
    out = filter_logits(logits, torch.full((8,), top_k), torch.full((8,), top_p), torch.full((8,), min_p))
    for r in range(8):
        kept = set(torch.nonzero(out[r] > float("-inf")).flatten().tolist())
        assert kept == reference_filter(logits[r], top_k, top_p, min_p)
        assert torch.equal(out[r][sorted(kept)], logits[r][sorted(kept)])  # survivors keep their logits


def test_each_row_uses_its_own_filter_settings():
    logits = random_logits(3, seed=5)
    out = filter_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0.0, 0.0, 0.3]))
    for r, (k, p, m) in enumerate([(2, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.3)]):
        assert set(torch.nonzero(out[r] > float("-inf")).flatten().tolist()) == reference_filter(logits[r], k, p, m)


def test_samples_follow_the_tempered_distribution_and_stay_inside_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 6000
    seqs = [seq(temperature=0.7) for _ in range(n)]
    tokens, _ = Sampler()(logits.expand(n, -1).contiguous(), seqs)
    freq = torch.bincount(tokens, minlength=6).float() / n
    expected = (logits[0] / 0.7).softmax(0)
    assert (freq - expected).abs().max() < 0.02, (freq, expected)
    tokens, _ = Sampler()(logits.expand(n, -1).contiguous(), [seq(temperature=1.5, top_k=2) for _ in range(n)])
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert set(tokens.tolist()) == {0, 1}
    assert abs(freq[0] - torch.softmax(logits[0, :2] / 1.5, 0)[0]) < 0.02


def test_penalties_against_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    # prompt holds tokens 0 and 1; the output so far holds 3 twice and 4 once.
    s = seq(prompt=(0, 1), output=(3, 3, 4), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = PenaltyTokens().apply(logits.clone(), [s])
    # repetition: seen tokens 0, 1, 3, 4 → positive ÷ 2, negative × 2; presence / frequency on output tokens 3, 4.
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 2 * 0.25, -2.0 * 2 - 0.5 - 1 * 0.25, 1.0]
    assert out[0].tolist() == pytest.approx(expected)
    untouched = PenaltyTokens().apply(logits.clone(), [seq(prompt=(0, 1), output=(3,))])
    assert torch.equal(untouched, logits)


def test_greedy_applies_penalties_first():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    tokens, _ = Sampler()(logits, [seq(prompt=(0,), temperature=0.0, repetition_penalty=2.0)])
    assert tokens.tolist() == [1]  # token 0 was seen: 3 / 2 < 2.5


def test_same_seed_same_tokens_whatever_the_batch():
    logits = random_logits(1, seed=3)[0]

    def draws(batch_size: int, row: int, seed: int, steps: int = 12, filler_seed=None) -> list[int]:
        sampler, me = Sampler(), seq(temperature=1.0, seed=seed)
        mates = [seq(temperature=0.9, seed=filler_seed) for _ in range(batch_size - 1)]
        out = []
        for _ in range(steps):
            batch = mates[:row] + [me] + mates[row:]
            all_logits = random_logits(batch_size, seed=len(out))
            all_logits[row] = logits
            tokens, _ = sampler(all_logits, batch)
            out.append(tokens[row].item())
        return out

    alone = draws(1, 0, seed=7)
    assert draws(5, 3, seed=7) == alone == draws(3, 1, seed=7, filler_seed=11)
    assert draws(1, 0, seed=8) != alone
    assert len(set(alone)) > 1  # the draws differ step to step: the generator advances


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = random_logits(3, seed=9)
    seqs = [seq(temperature=0.0, logprobs=3), seq(temperature=0.8, logprobs=0, repetition_penalty=1.3), seq()]
    tokens, logprobs = Sampler()(logits, seqs)
    expected = torch.log_softmax(logits.double(), dim=1)
    for r in (0, 1):
        info = logprobs[r]
        assert info.token_id == tokens[r].item()
        assert info.logprob == pytest.approx(expected[r, info.token_id].item(), abs=1e-5)
    top_vals, top_ids = expected[0].topk(3)
    assert [i for i, _ in logprobs[0].top] == top_ids.tolist()
    assert [v for _, v in logprobs[0].top] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert logprobs[1].top == [] and logprobs[2] is None


def test_sampling_params_take_the_generation_config_defaults():
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                           eos_token_id=[2, 7], max_new_tokens=64)
    p = SamplingParams(top_p=0.5).with_defaults(gen)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.5, 20, 1.05, 64)
    assert p.eos_token_ids == [2, 7] and p.min_p == 0.0
    plain = SamplingParams().with_defaults(None, eos_token_id=2)   # no generation config: built-ins, tokenizer EOS
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 256)
    assert plain.eos_token_ids == [2]
    greedy = SamplingParams().with_defaults(GenerationConfig(do_sample=False, eos_token_id=2))
    assert greedy.temperature == 0.0
    s = Sequence([1], SamplingParams(temperature=0.5, stop_token_ids=[9]).with_defaults(gen))
    assert s.stop_ids == {2, 7, 9}
    assert Sequence([1], SamplingParams(ignore_eos=True, stop_token_ids=[9]).with_defaults(gen)).stop_ids == {9}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(min_p=2.0),
                                 dict(max_tokens=0), dict(repetition_penalty=0.0), dict(logprobs=-1)])
def test_bad_sampling_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad).with_defaults(None)


@pytest.mark.parametrize("bad", [dict(kv_bits=6), dict(cache_max_entry_count=0.0), dict(block_size=0),
                                 dict(num_kv_tokens=3)])
def test_bad_engine_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        EngineConfig(**bad)


def test_min_tokens_holds_back_end_and_stop_tokens_until_reached():
    """EOS (7) and a stop token (9) lead every row by far; rows short of their min_tokens draw neither, greedy
    or sampled; a row that has reached it (or asks none) draws EOS."""
    logits = random_logits(4)
    logits[:, 7] = 50.0
    logits[:, 9] = 40.0
    seqs = [seq(output=(1, 2), temperature=0.0, min_tokens=3, eos_token_ids=[7], stop_token_ids=[9]),
            seq(output=(1, 2), temperature=1.0, seed=3, min_tokens=5, eos_token_ids=[7], stop_token_ids=[9]),
            seq(output=(1, 2, 3), temperature=0.0, min_tokens=3, eos_token_ids=[7]),
            seq(temperature=0.0, eos_token_ids=[7])]
    tokens, logprobs = Sampler()(logits, seqs)
    held = logits[0].clone()
    held[[7, 9]] = float("-inf")
    assert tokens[0].item() == held.argmax().item()
    assert tokens[1].item() not in (7, 9)
    assert tokens[2:].tolist() == [7, 7]


def test_min_tokens_beyond_max_tokens_is_refused():
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


# --- penalties from kept token state against penalties from counts rebuilt at every call ------------------

def rebuilt_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The oracle: the penalties with each sequence's token counts rebuilt from its whole lists at every call
    (the sampler's computation before it kept token state)."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
    if not rows:
        return logits
    vocab, sub = logits.shape[1], [seqs[i] for i in rows]

    def counts_of(token_lists):
        counts = torch.zeros(len(token_lists), vocab)
        for i, t in enumerate(token_lists):
            counts[i] += torch.bincount(torch.tensor(t, dtype=torch.long), minlength=vocab).float()
        return counts

    seen = counts_of([[t for t in s.token_ids if t < vocab] for s in sub]) > 0
    counts = counts_of([s.output_token_ids for s in sub])
    rep = torch.tensor([s.params.repetition_penalty for s in sub])[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in sub])[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in sub])[:, None]
    x = logits[rows]
    logits = logits.clone()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - presence * (counts > 0) - frequency * counts
    logits[rows] = x
    return logits


PENALTIES = [dict(), dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.3)]


class World:
    """Sequences sampled through one PenaltyTokens in batches that they join and leave (a sequence left out
    is waiting or preempted: it keeps its tokens), finishing, failing and arriving; every call's logits must
    equal the rebuilt ones exactly."""

    def __init__(self, vocab: int) -> None:
        self.pen, self.vocab, self.live, self.peak, self.calls = PenaltyTokens(), vocab, [], 0, 0
        self.done: list[Sequence] = []  # finished sequences stay referenced (as a caller may keep them)

    def add(self, prompt, kind: int, output=()) -> None:
        """A new sequence; one with output already is one whose state must be built from it (recomputed)."""
        self.live.append(seq(prompt, output, **PENALTIES[kind]))
        self.peak = max(self.peak, len(self.live))

    def finish(self, s: Sequence) -> None:
        s.status = SequenceStatus.FINISHED
        self.live.remove(s)
        self.done.append(s)

    def step(self, batch: list[Sequence], tokens: list[int], fail=None, sync_fails: int = 0) -> None:
        """Sample batch; append each its token, except `fail`, which ends without one (its request errored).
        sync_fails=n: the update raises at its n-th scatter (the 2nd comes after new rows' prompts are
        marked); the batch's sequences must not keep half-updated rows, and nobody gets a token."""
        self.calls += 1
        logits = torch.randn(len(batch), self.vocab, generator=torch.Generator().manual_seed(self.calls)) * 3
        scatters, pairs = [], sampler_module._pairs

        def failing_pairs(*args):
            scatters.append(1)
            if len(scatters) == sync_fails:
                raise RuntimeError("device lost")
            return pairs(*args)

        try:
            with mock.patch.object(sampler_module, "_pairs", failing_pairs):
                out = self.pen.apply(logits.clone(), batch)
        except RuntimeError as exc:
            assert str(exc) == "device lost"
            return
        assert torch.equal(out, rebuilt_penalties(logits.clone(), batch))
        for s, t in zip(batch, tokens):
            if s is fail:
                self.finish(s)
            else:
                s.append_token(t)
        # Rows of finished sequences are taken again: the pool grows only past the sequences alive at once.
        assert self.pen.prompt_seen is None or self.pen.prompt_seen.shape[0] <= max(8, 2 * self.peak)


def test_kept_penalty_state_equals_rebuilt_counts_over_many_steps():
    rng, vocab = random.Random(0), 50
    w = World(vocab)

    def prompt():
        return [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]

    for i in range(12):
        w.add(prompt(), i % 4)
    for _ in range(300):
        batch = rng.sample(w.live, rng.randint(1, len(w.live)))
        fail = rng.choice(batch) if rng.random() < 0.05 else None
        w.step(batch, [rng.randrange(vocab) for _ in batch], fail, sync_fails=rng.choice([0] * 30 + [1, 2]))
        if rng.random() < 0.1 and len(w.live) > 1:
            w.finish(rng.choice(w.live))
        while len(w.live) < 12:
            w.add(prompt(), rng.randrange(4), [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 40]))])
    assert w.pen.prompt_seen.shape[0] == 16  # 12 alive at most


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_kept_penalty_state_equals_rebuilt_counts_for_any_history(data):
    vocab = 12
    token, tokens = st.integers(0, vocab - 1), st.lists(st.integers(0, vocab - 1), max_size=6)
    w = World(vocab)
    for _ in range(data.draw(st.integers(1, 5))):
        w.add(data.draw(st.lists(token, min_size=1, max_size=20)), data.draw(st.integers(0, 3)), data.draw(tokens))
    for _ in range(data.draw(st.integers(1, 12))):
        order = data.draw(st.permutations(range(len(w.live))))
        batch = [w.live[i] for i in order[:data.draw(st.integers(1, len(w.live)))]]
        event = data.draw(st.sampled_from(["append", "fail", "sync fails 1", "sync fails 2", "finish and arrive"]))
        w.step(batch, data.draw(st.lists(token, min_size=len(batch), max_size=len(batch))),
               fail=batch[0] if event == "fail" else None, sync_fails=int(event[-1]) if "sync" in event else 0)
        if event == "finish and arrive" and w.live:
            w.finish(w.live[0])
        if event != "append" or not w.live:
            w.add(data.draw(st.lists(token, min_size=1, max_size=20)), data.draw(st.integers(0, 3)), data.draw(tokens))


def test_dropped_sequences_give_their_rows_back_and_ids_past_the_vocabulary_are_not_counted():
    pen, logits = PenaltyTokens(), random_logits(4, seed=2)
    for _ in range(5):  # 4 sequences at a time, dropped unfinished (a caller that forgot them)
        pen.apply(logits, [seq(prompt=(1, 2), output=(3,), repetition_penalty=1.5) for _ in range(4)])
        gc.collect()
    assert pen.prompt_seen.shape[0] == 8
    placeholder = seq(prompt=(1, V + 7, 2, V), output=(4,), repetition_penalty=1.5, frequency_penalty=0.5)
    plain = seq(prompt=(1, 2), output=(4,), repetition_penalty=1.5, frequency_penalty=0.5)
    assert torch.equal(pen.apply(logits[:1], [placeholder]), rebuilt_penalties(logits[:1], [plain]))


def test_a_call_counts_only_the_tokens_appended_since_the_last_one():
    pen, logits = PenaltyTokens(), random_logits(3, seed=4)
    seqs = [seq(prompt=range(1, 30), output=(1, 2, 3), repetition_penalty=1.2) for _ in range(3)]
    with mock.patch.object(sampler_module, "_pairs", wraps=sampler_module._pairs) as pairs:
        pen.apply(logits, seqs)
        assert [sum(len(t) for _, t in c.args[0]) for c in pairs.call_args_list] == [3 * 29, 3 * 3]
        for step in range(3):
            pairs.reset_mock()
            for s in seqs:
                s.append_token(step)
            assert torch.equal(pen.apply(logits, seqs), rebuilt_penalties(logits, seqs))
            assert [sum(len(t) for _, t in c.args[0]) for c in pairs.call_args_list] == [3]


def test_a_finished_sequence_sampled_again_keeps_its_row():
    """Not what the engine does, but no sequence of a batch may lose its row to another of the same batch."""
    pen, logits = PenaltyTokens(), random_logits(9, seed=6)
    seqs = [seq(prompt=(i, i + 1), output=(i + 2,), presence_penalty=1.0) for i in range(8)]
    pen.apply(logits[:8], seqs)  # the pool's 8 rows are all taken
    seqs[0].status = SequenceStatus.FINISHED
    batch = [seqs[0], seq(prompt=(30,), output=(31,), repetition_penalty=2.0)]
    assert torch.equal(pen.apply(logits[:2], batch), rebuilt_penalties(logits[:2], batch))


def engine_requests(poison_seed=None) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (20, 30, 12, 25)]
    base = dict(max_tokens=32, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, **base),
              SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.8, **base),
              SamplingParams(temperature=0.0, **base),
              SamplingParams(temperature=0.7, seed=9, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.5, **base)]
    requests = list(zip(ps, params))
    if poison_seed is not None:
        requests.insert(1, (ps[0], SamplingParams(temperature=0.8, seed=poison_seed, repetition_penalty=1.2, **base)))
    return requests


def run_engine(eng: Engine, requests) -> list[tuple[str, list[int]]]:
    ids = [eng.add_request(p, sp) for p, sp in requests]
    tokens, reasons = {i: [] for i in ids}, {}
    for _ in range(500):
        if len(reasons) == len(ids):
            break
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert len(reasons) == len(ids), "the requests did not finish"
    return [(reasons[i], tokens[i]) for i in ids]


@pytest.mark.parametrize("kv_tokens", [2048, 160])
def test_engine_tokens_with_penalties_equal_those_from_rebuilt_counts(tiny_models, kv_tokens, monkeypatch):
    # 160 KV tokens (10 blocks) for four sequences that end at 44–62 tokens: some are preempted and recomputed.
    eng = Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=kv_tokens, enable_prefix_caching=False))
    requests = engine_requests()
    kept = run_engine(eng, requests)
    assert (eng.scheduler.num_preemptions > 0) == (kv_tokens == 160)
    with monkeypatch.context() as m:
        m.setattr(eng.sampler.penalties, "apply", rebuilt_penalties)
        assert run_engine(eng, requests) == kept
    unpenalised = [(p, SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=32, ignore_eos=True))
                   for p, sp in requests]
    plain = run_engine(eng, unpenalised)
    assert [plain[i] != kept[i] for i in range(4)] == [True, True, False, True]  # the penalties matter
    assert run_engine(eng, requests) == kept  # again, on rows taken over from the finished sequences
    assert eng.sampler.penalties.prompt_seen.shape[0] == 8


def test_a_request_failing_after_the_penalties_leaves_the_others_tokens_alone(tiny_models):
    eng = Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=2048))
    alone = run_engine(eng, engine_requests())
    exponential = eng.sampler._exponential

    def poisoned(probs, seqs):  # raises in the sampler after its penalties were brought up to date
        if any(s.params.seed == 13 for s in seqs):
            raise ValueError("bad settings")
        return exponential(probs, seqs)

    eng.sampler._exponential = poisoned
    mixed = run_engine(eng, engine_requests(poison_seed=13))
    assert mixed[1] == ("error", [])
    assert mixed[:1] + mixed[2:] == alone
