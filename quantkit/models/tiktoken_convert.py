"""A tiktoken BPE vocabulary file → a transformers fast tokenizer, without tiktoken and without remote code.

The file (Qwen's `qwen.tiktoken`) holds one `base64(token bytes) rank` per line; a token's rank is its id
and its merge priority: tiktoken splits text with a regular expression, then joins, within each piece,
the adjacent pair whose joined bytes have the lowest rank until none is in the vocabulary (a piece that
is itself a token is taken whole). transformers' `TikTokenConverter` turns the ranks into byte-level BPE
vocabulary + merges with that behaviour; this module only reads the file itself (tiktoken is not
needed) and adds the family's normalizer, special tokens and chat template.
"""

from __future__ import annotations

import base64
import binascii
import functools
from pathlib import Path
from typing import Optional

from quantkit.config import UserError


@functools.lru_cache(maxsize=4)
def _read_ranks(path: str, mtime_ns: int) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (binascii.Error, ValueError):
                raise UserError(f"{path}:{n} is not a tiktoken line ('<base64 token> <rank>')") from None
            if token in ranks:
                raise UserError(f"{path}:{n}: token {token!r} is listed twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{path}: the ranks are not 0 … {len(ranks) - 1}, each once; not a tiktoken vocabulary")
    return ranks


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken BPE file, checked (ranks 0 … n−1, each once)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist: the checkpoint's tiktoken vocabulary is needed to build its tokenizer")
    return _read_ranks(str(path), path.stat().st_mtime_ns)


def tiktoken_to_fast(
    path: str | Path,
    pattern: str,
    special_tokens: list[str],
    *,
    nfc: bool = False,
    eos_token: Optional[str] = None,
    pad_token: Optional[str] = None,
    chat_template: Optional[str] = None,
    model_max_length: Optional[int] = None,
):
    """A fast tokenizer that encodes as tiktoken does with `pattern` and the ranks of `path`.

    `special_tokens` take the ids after the ranks, in order, and are matched whole anywhere in the text
    (tiktoken's allowed_special="all"). `nfc`: the text is NFC-normalized first (Qwen's tokenizer does).
    No BOS or EOS is added to an encoded text."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from quantkit.models.tokenizer_convert import portable_fast_class

    ranks = read_tiktoken_ranks(path)

    class _Converter(TikTokenConverter):
        # The base class reads the file with tiktoken; the ranks are already read here.
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url):
            return ranks

    tok = _Converter(str(path), pattern=pattern).converted()
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens])
    for i, t in enumerate(special_tokens):
        if tok.token_to_id(t) != len(ranks) + i:
            raise UserError(f"{path}: special token {t!r} would not get id {len(ranks) + i}; is it in the ranks?")
    kwargs = dict(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token, chat_template=chat_template,
                  model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    return portable_fast_class()(**{k: v for k, v in kwargs.items() if v is not None})
