"""Perplexity by transformers' own model (`eval ppl --reference`): the protocol against a hand computation."""

import math

import pytest
import torch

from quantkit.eval.perplexity import perplexity
from quantkit.formats.kv_stats import KVStats
from quantkit_testing.tiny import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def model_and_tok():
    return make_tiny_model("qwen2"), make_tokenizer()


def test_plain_protocol_matches_a_hand_computation(model_and_tok, text_file):
    model, tok = model_and_tok
    res = perplexity(model, tok, str(text_file), seqlen=64, windows=3, progress=False)
    # By hand: whole text tokenized once, three consecutive windows, float64 log-softmax per token.
    ids = tok(text_file.read_text(), add_special_tokens=False)["input_ids"]
    nll = 0.0
    with torch.no_grad():
        for w in range(3):
            chunk = torch.tensor(ids[w * 64:(w + 1) * 64])
            logp = model(chunk[None]).logits[0].double().log_softmax(-1)
            nll -= sum(logp[i, chunk[i + 1]].item() for i in range(63))
    assert res.tokens == 3 * 63 and res.windows == 3 and res.kv == "KV16"
    assert res.ppl == pytest.approx(math.exp(nll / (3 * 63)), rel=1e-5)


def test_stats_file_round_trip(tmp_path):
    from quantkit.formats.kv_stats import read_kv_stats, write_kv_stats

    t = torch.randn(2, 3, 4)
    stats = KVStats(t, t + 1, t.abs() + 1, t, t + 2, t.abs() + 2, tokens=100, windows=2)
    back = read_kv_stats(write_kv_stats(stats, tmp_path))
    assert torch.equal(back.k_max, stats.k_max) and back.tokens == 100 and back.summary()["layers"] == 2
