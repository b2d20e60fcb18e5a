"""CUDA-graph decoding (quantkit.runtime.decode) of a W4 checkpoint against eager `model.generate`.

Both decode greedily from the same left-padded prompts. Our steps replay a captured graph over a
static cache; transformers' run eagerly over its dynamic cache, so the attention sums in another
order and fp16 logits differ in the last bits. A random-weight model has near-tied logits now and
then, so the token streams must agree until the first place where they part, and there the token we
chose must be within a hair of the best one in transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.runtime import decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
NEW_TOKENS = 24
# A flip of the greedy token is excused only where transformers' top two logits lie this close
# (relative to the spread of that row's logits); the two paths differ by about 1e-3 of it.
NEAR_TIE = 0.02


def first_disagreement(ours: torch.Tensor, theirs: torch.Tensor) -> int | None:
    diff = (ours != theirs).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def test_graph_decode_matches_eager_generate(small_llama, monkeypatch):
    model, tok = quantkit.load(small_llama["w4g128"], device=DEVICE)
    tok.padding_side = "left"
    enc = tok(["the model quantizes weights into groups of integers", "a cache"], return_tensors="pt",
              padding=True).to(DEVICE)
    assert (enc["attention_mask"] == 0).any()  # the second row is left-padded
    decoders = []

    class RecordedDecoder(decode.StaticDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            decoders.append(self)

    monkeypatch.setattr(decode, "StaticDecoder", RecordedDecoder)
    with torch.no_grad():
        runs = [decode.generate(model, enc["input_ids"], enc["attention_mask"], NEW_TOKENS,
                                pad_id=tok.pad_token_id, use_graph=True) for _ in range(2)]
        ref = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    # Every step after the second was a replay of a captured graph (a failed capture decodes eagerly).
    assert len(decoders) == 2 and all(d.graph is not None and d.use_graph for d in decoders)
    assert decoders[0].steps == NEW_TOKENS - 1
    assert torch.equal(runs[0], runs[1])  # two captures, replayed 22 times each: the same tokens

    n = enc["input_ids"].shape[1]
    ours, theirs = runs[0][:, n:], ref.sequences[:, n:]
    assert ours.shape == theirs.shape == (2, NEW_TOKENS)
    for row in range(2):
        j = first_disagreement(ours[row], theirs[row])
        if j is None:
            continue
        logits = ref.logits[j][row].float()
        gap = float(logits.max() - logits[ours[row, j]])
        assert gap <= NEAR_TIE * float(logits.std()), (row, j, gap, ours[row].tolist(), theirs[row].tolist())
