"""A sentencepiece BPE tokenizer (InternLM2's `tokenizer.model`) → a transformers fast tokenizer, no remote code.

InternLM2 ships its tokenizer as Python files named by an `auto_map`; transformers runs them only after
asking "Do you wish to run the custom code?". Their behaviour is plain sentencepiece: the text is split
on the added tokens of tokenizer_config.json (`<|im_start|>`, `<|im_end|>`, …), each piece between them
is encoded by sentencepiece on its own (so the model's dummy prefix, when it has one, starts every piece),
and BOS is put first. This module builds the same thing from the `tokenizers` library's parts, following
the settings stored in the sentencepiece model (normalizer, dummy prefix, whitespace, byte fallback), so
the export carries a `tokenizer.json` that any transformers loads as it is.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from quantkit.config import UserError, read_json

log = logging.getLogger(__name__)

# sentencepiece piece types (sentencepiece_model.proto: ModelProto.SentencePiece.Type)
_NORMAL, _USER_DEFINED = 1, 4
_BPE = 2  # TrainerSpec.ModelType


def names_remote_tokenizer(path: Path) -> bool:
    """True when the checkpoint's tokenizer is Python code of its own (an `auto_map` naming AutoTokenizer)."""
    for name in ("tokenizer_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            auto_map = json.loads(f.read_text()).get("auto_map") or {}
        except (json.JSONDecodeError, AttributeError):
            continue
        # A list is the old form of a tokenizer_config's auto_map: [slow class, fast class].
        if isinstance(auto_map, list) or "AutoTokenizer" in auto_map:
            return True
    return False


def _read_proto(model_file: Path):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise UserError(
            f"converting {model_file} to a fast tokenizer needs sentencepiece and protobuf: "
            "pip install sentencepiece protobuf"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    if proto.trainer_spec.model_type != _BPE:
        raise UserError(f"{model_file} is not a BPE sentencepiece model; quantkit converts only BPE ones (InternLM2's)")
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise UserError(f"{model_file} puts whitespace after pieces (treat_whitespace_as_suffix): not convertible")
    return proto


def _bpe_merges(proto, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges that make sentencepiece's choice: the pair whose joined piece scores highest merges first.

    Only normal pieces take part (sentencepiece never merges into or out of control, byte or
    user-defined pieces). A trained BPE model scores its pieces by rank, so scores do not tie.
    """
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces)
              if p.type == _NORMAL and vocab.get(p.piece) == i}
    ranked = []
    for piece, (score, i) in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    return [(left, right) for _, _, left, right in sorted(ranked)]


def _added_tokens(tokenizer_config: dict[str, Any]):
    from tokenizers import AddedToken

    out = {}
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, str):
            entry = {"content": entry}
        out[int(key)] = AddedToken(
            entry["content"], single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", False),
            special=entry.get("special", True),
        )
    return out


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def sentencepiece_to_fast(model_file: str | Path, tokenizer_config: dict[str, Any] | None = None):
    """A transformers fast tokenizer that encodes and decodes as the sentencepiece model + tokenizer_config do.

    `tokenizer_config` is the checkpoint's tokenizer_config.json: its added_tokens_decoder (which may
    rename vocabulary pieces, e.g. InternLM2's placeholders to `<|im_start|>`), special tokens,
    add_bos_token / add_eos_token (InternLM2's defaults: BOS yes, EOS no) and chat_template.
    A renamed piece's old text (`[UNUSED_TOKEN_146]`) is no longer one token: it is encoded as text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model_file = Path(model_file)
    cfg = dict(tokenizer_config or {})
    proto = _read_proto(model_file)
    added = _added_tokens(cfg)
    id_to_piece = {i: p.piece for i, p in enumerate(proto.pieces)}
    for i, t in added.items():
        id_to_piece[i] = t.content
    vocab = {piece: i for i, piece in sorted(id_to_piece.items(), reverse=True)}  # the lowest id wins a duplicate
    spec, trainer = proto.normalizer_spec, proto.trainer_spec

    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=_bpe_merges(proto, vocab), unk_token=id_to_piece[trainer.unk_id],
        fuse_unk=True, byte_fallback=trainer.byte_fallback,
    ))
    norm = []
    if spec.precompiled_charsmap:
        norm.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        # sentencepiece counts only the space character here; newlines and tabs stay.
        norm += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        norm.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:
        # The normalizer runs on each piece between added tokens, as sentencepiece ran on each.
        norm.append(normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    # Sentencepiece emits user-defined pieces whole wherever they occur in the text.
    user_defined = [p.piece for i, p in enumerate(proto.pieces)
                    if p.type == _USER_DEFINED and id_to_piece[i] == p.piece]
    if user_defined:
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    dec = [decoders.Replace("▁", " ")]
    if trainer.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    tok.add_tokens([t for _, t in sorted(added.items()) if not t.special])
    tok.add_special_tokens([t for _, t in sorted(added.items()) if t.special])
    for i, t in added.items():
        if tok.token_to_id(t.content) != i:
            raise UserError(f"{model_file}: tokenizer_config.json gives {t.content!r} id {i}, the model another")

    def special(name: str, default: str | None) -> str | None:
        return _token_text(cfg.get(name, default))

    bos, eos = special("bos_token", "<s>"), special("eos_token", "</s>")
    add_bos, add_eos = bool(cfg.get("add_bos_token", True)), bool(cfg.get("add_eos_token", False))
    first = [(bos, tok.token_to_id(bos))] if add_bos and bos else []
    last = [(eos, tok.token_to_id(eos))] if add_eos and eos else []
    head, tail = [t for t, _ in first], [t for t, _ in last]
    tok.post_processor = processors.TemplateProcessing(
        single=head + ["$A"] + tail, pair=head + ["$A"] + tail + head + ["$B"] + tail, special_tokens=first + last,
    )
    kwargs = dict(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=special("unk_token", id_to_piece[trainer.unk_id]),
        pad_token=special("pad_token", None), add_bos_token=add_bos, add_eos_token=add_eos,
        clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
        padding_side=cfg.get("padding_side", "left"),
        model_max_length=cfg.get("model_max_length", int(1e30)),
    )
    if cfg.get("chat_template"):
        kwargs["chat_template"] = cfg["chat_template"]
    return portable_fast_class()(**{k: v for k, v in kwargs.items() if v is not None})


@functools.cache
def portable_fast_class():
    from transformers import PreTrainedTokenizerFast

    # transformers 5 saves its generic fast tokenizer as "TokenizersBackend", a class name that
    # transformers 4 (and the engines pinned to it) cannot load; both load "PreTrainedTokenizerFast".
    return type("PreTrainedTokenizerFast", (PreTrainedTokenizerFast,), {"__module__": __name__})


def __getattr__(name: str):
    # The class is made on first use (transformers is imported lazily); pickle finds it here by name.
    if name == "PreTrainedTokenizerFast":
        return portable_fast_class()
    raise AttributeError(name)


def load_converted(path: Path):
    """The fast tokenizer of a checkpoint whose own tokenizer is remote code, from its tokenizer.model."""
    model_file = path / "tokenizer.model"
    if not model_file.is_file():
        raise UserError(
            f"{path}: its tokenizer is remote code (auto_map) and it has no tokenizer.model to convert; "
            "quantkit runs no remote code: add the sentencepiece tokenizer.model of this model"
        )
    cfg = read_json(path / "tokenizer_config.json")
    template = path / "chat_template.jinja"
    if template.is_file() and not cfg.get("chat_template"):
        cfg["chat_template"] = template.read_text()
    if "internlm2" not in json.dumps(cfg.get("auto_map", "")).lower():
        log.warning("%s: tokenizer converted from tokenizer.model without running its remote code; "
                    "anything that code adds to sentencepiece is not kept", path)
    return sentencepiece_to_fast(model_file, cfg)
