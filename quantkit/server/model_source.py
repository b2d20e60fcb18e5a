"""What `quantkit serve MODEL` serves: an HF directory or quantkit export, or a random-weight model.

`random:SHAPE:WEIGHTS` (e.g. `random:llama2-7b:w4`, `random:tiny:fp16`) builds a model of a real shape
with random weights straight on the device (engine.random_model), for measuring the server without a
checkpoint. Such a model has no tokenizer: it gets a byte-level one (`byte_tokenizer`) in which every
byte of the text is one token, so N ASCII characters are N prompt tokens, and every other id of the
vocabulary decodes to a short word (` w1234`). `--tokenizer DIR` gives it a real one instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from quantkit.config import UserError

RANDOM_PREFIX = "random:"
SPECIALS = ("<unk>", "<s>", "</s>")   # ids 0, 1, 2: the random shapes' bos 1 and eos 2
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def parse_random_spec(model: str) -> Optional[tuple[str, str]]:
    """(shape, weights) of `random:SHAPE:WEIGHTS`, None for any other MODEL; a malformed spec is refused."""
    if not model.startswith(RANDOM_PREFIX):
        return None
    from quantkit.engine.random_model import SHAPES, WEIGHTS

    parts = model[len(RANDOM_PREFIX):].split(":")
    if len(parts) != 2 or parts[0] not in SHAPES or parts[1] not in WEIGHTS:
        raise UserError(f"{model!r} is not a random model: write random:SHAPE:WEIGHTS with SHAPE one of "
                        f"{', '.join(SHAPES)} and WEIGHTS one of {', '.join(WEIGHTS)} (e.g. random:llama2-7b:w4)")
    return parts[0], parts[1]


def check_model_arg(model: str) -> Optional[tuple[str, str]]:
    """Refuse a MODEL that is neither a path that exists nor a valid random spec (before any loading);
    the random spec's (shape, weights) or None."""
    spec = parse_random_spec(model)
    if spec is None and not Path(model).exists():
        raise UserError(f"model {model!r} not found: give an HF model directory, a quantkit export or "
                        "random:SHAPE:WEIGHTS")
    return spec


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte as one printable character (printable ASCII and Latin-1
    map to themselves, the rest to characters from U+0100 on), as byte-level decoders expect."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer(vocab_size: int):
    """A transformers fast tokenizer of `vocab_size` ids: <unk> <s> </s>, the 256 bytes (one token each,
    no merges), then one word per remaining id. No BOS is added, so a text's token count is its length
    in bytes. Carries a plain chat template (`<|role|>` lines)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIALS) + 256:
        raise UserError(f"a vocabulary of {vocab_size} ids cannot hold the byte tokenizer (259 ids)")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in bytes_to_unicode().items():
        vocab[ch] = len(SPECIALS) + b
    for i in range(len(vocab), vocab_size):
        vocab[f"\u0120w{i}"] = i            # U+0120 is the byte-level alphabet's space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out


def load_engine(model: str, config: Any, tokenizer: Optional[str] = None):
    """An Engine over MODEL (a directory or `random:SHAPE:WEIGHTS`) with EngineConfig `config`;
    `tokenizer`, a directory, replaces the model's own tokenizer (or the random model's byte one)."""
    spec = check_model_arg(model)
    import torch

    from quantkit.engine import Engine

    tok = _load_tokenizer_dir(tokenizer) if tokenizer else None
    if spec is None:
        engine = Engine(model, config)
        if tok is not None:
            engine.tokenizer = tok
        return engine
    from quantkit.config import check_device
    from quantkit.engine.model import resolve_dtype
    from quantkit.engine.random_model import build_random_model

    check_device(config.device)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(config.dtype, {}, device)  # auto: float16 on CUDA, float32 on the CPU
    net = build_random_model(spec[0], spec[1], device, dtype)
    if tok is None:
        tok = byte_tokenizer(net.config.vocab_size)
    import dataclasses

    config = dataclasses.replace(config, device=str(device), dtype=dtype)
    return Engine.from_model(net, tok, config)


def _load_tokenizer_dir(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise UserError(f"--tokenizer {path!r} is not a directory: give a folder with tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tokenizer {path!r}: no tokenizer could be read there ({exc})") from None
