"""Logprobs' `token` and `bytes`: the tokenizer's own spelling of each id and the bytes of text it stands
for, for a byte-level BPE (GPT-2's `Ġ` alphabet), a SentencePiece BPE with byte fallback (`▁`, `<0xE2>`)
and a slow SentencePiece tokenizer; then the Renderer's chat and completions bodies, and a live server's."""

from __future__ import annotations

import pytest
import requests

from quantkit.engine.sampler import TokenLogprobs
from quantkit.server.generation import Renderer
from quantkit.server.token_spelling import TokenSpeller
from quantkit_testing.tiny import make_sentencepiece_tokenizer, make_tokenizer

# ☃ (3 bytes) and 中 are outside the byte-level tokenizer's merges: a character split over byte tokens.
TEXT = "the model\nquantizes é ☃ weights 中"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    root = tmp_path_factory.mktemp("spelling")
    sp = make_sentencepiece_tokenizer(root / "sp")
    slow = SentencePieceBackend(vocab_file=str(root / "sp" / "tokenizer.model"), bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>")
    return {"byte-level": make_tokenizer(), "sentencepiece": sp, "sentencepiece-slow": slow}


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "sentencepiece-slow"])
def test_tokens_are_spelled_as_the_tokenizer_does_and_their_bytes_make_the_text(tokenizers, kind):
    tok = tokenizers[kind]
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    spell = TokenSpeller(tok)
    spelled = [spell(i) for i in ids]
    assert [s.token for s in spelled] == tok.convert_ids_to_tokens(ids)
    joined = bytes(b for s in spelled for b in s.bytes)
    if kind == "byte-level":
        assert joined == TEXT.encode("utf-8")
    else:  # SentencePiece's dummy prefix (a space its decoder strips again); its normalizer made \n a space
        assert joined == (" " + TEXT.replace("\n", " ")).encode("utf-8")
    if kind == "sentencepiece":
        assert joined == b" " + tok.decode(ids).encode("utf-8")
    by_token = {s.token: bytes(s.bytes) for s in spelled}
    if kind == "byte-level":
        assert by_token["Ċ"] == b"\n" and by_token["Ġweights"] == b" weights"
        snowman = [s for s in spelled if s.bytes and s.bytes[0] >= 0x80 and len(s.bytes) < 3]
        assert snowman, "☃ and 中 should be split over byte tokens here"  # each gives its own partial bytes
    else:
        assert by_token["<0xE2>"] == b"\xe2" and by_token["▁weights"] == b" weights"
    bos = spell(tok.bos_token_id)
    assert bos.token == tok.bos_token and bytes(bos.bytes) == tok.bos_token.encode()


def test_newline_byte_token(tokenizers):
    tok = tokenizers["sentencepiece"]
    newline = tok.convert_tokens_to_ids("<0x0A>")
    assert TokenSpeller(tok)(newline) == ("<0x0A>", [10])


def test_renderer_bodies(tokenizers):
    tok = tokenizers["byte-level"]
    ids = tok("é☃x", add_special_tokens=False)["input_ids"]
    entries = [TokenLogprobs(i, -0.5, [(i, -0.5), (ids[0], -2.0)]) for i in ids]
    spell = TokenSpeller(tok)
    chat = Renderer("chat", "m", spell).logprobs(entries)["content"]
    assert [e["token"] for e in chat] == tok.convert_ids_to_tokens(ids)
    assert bytes(b for e in chat for b in e["bytes"]).decode() == "é☃x"
    assert chat[0]["top_logprobs"][1] == {"token": chat[0]["token"], "logprob": -2.0, "bytes": chat[0]["bytes"]}
    legacy = Renderer("completions", "m", spell).logprobs(entries, offset=10)
    assert legacy["tokens"] == tok.convert_ids_to_tokens(ids)
    assert all(set(d) == {legacy["tokens"][i], legacy["tokens"][0]} for i, d in enumerate(legacy["top_logprobs"]))
    # Offsets count characters of the text: a character split over byte tokens moves them once.
    assert len(ids) == 6  # é and ☃ are bytes here: é in 2 tokens, ☃ in 3, then x
    assert legacy["text_offset"] == [10, 10, 11, 11, 11, 12]


def test_server_logprobs_spell_tokens_and_carry_their_bytes(qk_server, chat_tokenizer):
    out = requests.post(qk_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "the model quantizes"}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json()
    content = out["choices"][0]["logprobs"]["content"]
    vocab = chat_tokenizer.get_vocab()
    # The tiny model has 320 ids, its tokenizer 300: an id past the vocabulary has no spelling and no text.
    known = lambda e: e["token"] in vocab or (e["token"] == "" and e["bytes"] == [])  # noqa: E731
    assert len(content) == 8 and all(known(e) and all(known(t) for t in e["top_logprobs"]) for e in content)
    assert sum(e["token"] != "" for e in content) >= 4
    text = bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")  # a random model: stray bytes
    assert text == out["choices"][0]["message"]["content"]
