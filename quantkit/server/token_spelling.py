"""How a tokenizer spells one token and which bytes of text it stands for: the `token` and `bytes` of
OpenAI's logprobs.

`token` is the tokenizer's own string for the id (`convert_ids_to_tokens`): SentencePiece's `▁hello`,
byte-level BPE's `Ġhello`, a byte token `<0x0A>`. Unlike the decoded text it is never empty or `�`, so
two ids never share it. `bytes` is what the token adds to the text: `▁hello` → b" hello", `<0x0A>` → [10],
a byte-level token through its alphabet back to bytes; a token holding part of a multi-byte character
gives that part. Special and added tokens give the UTF-8 of their content.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple, Optional

from quantkit.server.model_source import bytes_to_unicode

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
BYTE_LEVEL_ALPHABET = {ch: b for b, ch in bytes_to_unicode().items()}


class TokenSpelling(NamedTuple):
    token: str          # the tokenizer's string for the id
    bytes: list[int]    # the bytes of text it stands for


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The `type`s of a fast tokenizer's decoder (a Sequence's parts included), plus "Metaspace" for a
    slow SentencePiece tokenizer; empty when unknown."""
    if getattr(tokenizer, "sp_model", None) is not None:
        return {"Metaspace", "ByteFallback"}
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    kinds: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "Replace" and "▁" in json.dumps(node.get("pattern"), ensure_ascii=False):
                kinds.add("Metaspace")  # Llama's decoder: Replace ▁ → space, ByteFallback, Fuse, Strip
            kinds.add(str(node.get("type")))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return kinds


def bytes_of_tokens(tokenizer: Any) -> Callable[[int, str], bytes]:
    """A function (id, the tokenizer's string for it) → the token's bytes, for this tokenizer's kind."""
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
    kinds = _decoder_kinds(tokenizer)

    def byte_level(token: str) -> Optional[bytes]:
        if all(ch in BYTE_LEVEL_ALPHABET for ch in token):
            return bytes(BYTE_LEVEL_ALPHABET[ch] for ch in token)
        return None

    def sentencepiece(token: str) -> bytes:
        byte = BYTE_TOKEN.fullmatch(token)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")

    def of(token_id: int, token: str) -> bytes:
        if token_id in added:
            return token.encode("utf-8")
        if "ByteLevel" in kinds:
            return byte_level(token) or token.encode("utf-8")
        if "Metaspace" in kinds or "ByteFallback" in kinds:
            return sentencepiece(token)
        return tokenizer.decode([token_id]).encode("utf-8")  # another kind: its decoded text

    return of


class TokenSpeller:
    """`speller(token_id)` → TokenSpelling, remembered per id. Without a tokenizer: empty."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: Optional[Callable[[int, str], bytes]] = None
        self._known: dict[int, TokenSpelling] = {}

    def __call__(self, token_id: int) -> TokenSpelling:
        known = self._known.get(token_id)
        if known is not None:
            return known
        if self.tokenizer is None:
            spelling = TokenSpelling("", [])
        else:
            if self._bytes is None:
                self._bytes = bytes_of_tokens(self.tokenizer)
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            token = "" if token is None else str(token)
            spelling = TokenSpelling(token, list(self._bytes(token_id, token)))
        self._known[token_id] = spelling
        return spelling
