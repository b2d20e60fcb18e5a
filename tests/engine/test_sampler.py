"""Sampler against direct computations, and SamplingParams' defaults from a generation config."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

from quantkit.config import ConfigError
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.sampler import Sampler, apply_penalties, filter_logits
from quantkit.engine.sequence import Sequence

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
    out = apply_penalties(logits.clone(), [s])
    # repetition: seen tokens 0, 1, 3, 4 → positive ÷ 2, negative × 2; presence / frequency on output tokens 3, 4.
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 2 * 0.25, -2.0 * 2 - 0.5 - 1 * 0.25, 1.0]
    assert out[0].tolist() == pytest.approx(expected)
    untouched = apply_penalties(logits.clone(), [seq(prompt=(0, 1), output=(3,))])
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
