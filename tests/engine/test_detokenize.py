"""IncrementalDetokenizer on real tokenizers: the deltas add up to the decoded text, never split a character,
and stop strings end the text before them."""

from __future__ import annotations

import pytest

from quantkit.engine.config import SamplingParams
from quantkit.engine.detokenize import IncrementalDetokenizer
from quantkit.engine.sequence import Sequence, SequenceStatus
from quantkit_testing.tiny import make_sentencepiece_tokenizer, make_tokenizer

TEXTS = [
    " the model quantizes weights into groups of integers",
    " 上海是中国最大的城市之一 😀 the cache keeps keys 和值 — é Ω\n\n  two  spaces",
    "😀😀 键和值😀 x_12 = 345",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "byte-bpe": make_tokenizer(),
        "sentencepiece": make_sentencepiece_tokenizer(root / "sp"),
        "sentencepiece-no-prefix": make_sentencepiece_tokenizer(
            root / "sp-raw", add_dummy_prefix=False, remove_extra_whitespaces=False,
            normalization_rule_name="identity"),
    }


def stream(tokenizer, prompt_ids, output_ids, params=None, finish_reason="length", stop_reason=None):
    """Feed output_ids one by one as the engine does; the last one finishes the sequence."""
    seq = Sequence(prompt_ids, params or SamplingParams())
    detok = IncrementalDetokenizer(tokenizer, seq)
    deltas = []
    for i, token_id in enumerate(output_ids):
        seq.append_token(token_id)
        if i == len(output_ids) - 1:
            seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, finish_reason, stop_reason
        deltas.append(detok.step(token_id))
        if detok.stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("name", ["byte-bpe", "sentencepiece", "sentencepiece-no-prefix"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_decoded_text(tokenizers, name, text):
    tok = tokenizers[name]
    prompt = tok("Hi, pls intro yourself.")["input_ids"]
    output = tok(text, add_special_tokens=False)["input_ids"]
    assert len(output) > len(text) // 4  # several tokens per character somewhere: byte pieces are exercised
    deltas, _ = stream(tok, prompt, output)
    assert all("\ufffd" not in d for d in deltas), deltas  # no character is emitted half-made
    whole = tok.decode(prompt + output, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert whole.startswith(head)
    assert "".join(deltas) == whole[len(head):]
    if name != "sentencepiece":  # no dummy prefix: the output decodes alone to the same text
        assert "".join(deltas) == tok.decode(output, clean_up_tokenization_spaces=False) == text
    # A multi-byte character arrives in several tokens: some steps emit nothing, the text comes whole later.
    if "😀" in text:
        assert "" in deltas[:-1]


def test_stop_string_ends_the_text_before_it(tokenizers):
    tok = tokenizers["byte-bpe"]
    prompt = tok("the model")["input_ids"]
    output = tok(" quantizes weights into groups of integers and a scale", add_special_tokens=False)["input_ids"]
    deltas, detok = stream(tok, prompt, output, SamplingParams(stop=["groups of", "never"]))
    assert detok.stopped and detok.stop_string == "groups of"
    assert "".join(deltas) == " quantizes weights into "
    # It stopped on the token that completed the stop string, not later.
    consumed = tok.decode(output[:len(deltas)])
    assert "groups of" in consumed and "groups of" not in tok.decode(output[:len(deltas) - 1])
    assert detok.step() == ""  # nothing more after a stop


def test_stop_string_prefix_is_held_back_then_released(tokenizers):
    tok = tokenizers["byte-bpe"]
    text = " keys and values for every key"
    output = tok(text, add_special_tokens=False)["input_ids"]
    deltas, detok = stream(tok, tok("the cache")["input_ids"], output, SamplingParams(stop=["keys!"]))
    assert not detok.stopped
    assert "".join(deltas) == text  # the held-back tail comes out when the sequence ends
    # While running, the last len("keys!") - 1 characters were never emitted (they might start a stop string).
    emitted_before_end = "".join(deltas[:-1])
    assert len(emitted_before_end) <= len(tok.decode(output[:-1])) - 4


def test_earliest_of_several_stop_strings_wins(tokenizers):
    tok = tokenizers["sentencepiece"]
    output = tok(" 上海是中国最大的城市之一 the cache", add_special_tokens=False)["input_ids"]
    deltas, detok = stream(tok, tok("x")["input_ids"], output, SamplingParams(stop=["the", "最大"]))
    assert detok.stop_string == "最大"
    assert "".join(deltas) == " 上海是中国"


def test_stop_token_text_is_not_emitted(tokenizers):
    tok = tokenizers["byte-bpe"]
    output = tok(" keys and values.", add_special_tokens=False)["input_ids"]
    stop_id = output[-1]
    deltas, _ = stream(tok, tok("the cache")["input_ids"], output, SamplingParams(stop_token_ids=[stop_id]),
                       finish_reason="stop", stop_reason=stop_id)
    assert "".join(deltas) == tok.decode(output[:-1])
