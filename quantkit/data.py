"""Calibration and evaluation text: named datasets (ptb, wikitext2, pydoc), local .txt/.jsonl files.

Calibration samples are `n` windows of `seqlen` tokens drawn at seeded random offsets from the
tokenized text, without replacement (`calibration_windows`); evaluation windows are the text's
consecutive non-overlapping windows. The dataset manifest ships inside the package
(quantkit/calib_data/manifest.json), so named datasets work from a plain `pip install`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.resources
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from quantkit.config import CalibConfig, UserError

log = logging.getLogger(__name__)

# Package data (pyproject's package-data), not a file of the source tree: found from a wheel install too.
MANIFEST = importlib.resources.files("quantkit") / "calib_data" / "manifest.json"
DATA_DIR_ENV = "QUANTKIT_DATA_DIR"


class DataError(UserError):
    """Text cannot be had; the message says which file to put where."""


@dataclass(frozen=True)
class TextSource:
    """Where a text came from, for reports."""

    name: str
    split: str
    origin: str  # a file path, "hub:<id>" or "builtin:<module>"
    chars: int
    sampling: str = ""  # how calibration windows were drawn from it (`window_sampling`)


def manifest() -> dict:
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


def _read_local(path: Path) -> str:
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}:{i} is not valid JSON; a .jsonl file needs one object per line") from None
            if not isinstance(record, dict) or "text" not in record:
                raise DataError(f"{path}:{i} has no 'text' field; each line must be {{\"text\": ...}}")
            texts.append(str(record["text"]))
        return "\n\n".join(texts)
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _hub_reachable() -> bool:
    """A 3-second connection probe, so that an offline machine fails at once instead of retrying for minutes."""
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def _from_hub(entry: dict, split: str) -> Optional[str]:
    if not _hub_reachable():
        return None
    try:
        import datasets

        hub = entry["hub"]
        ds = datasets.load_dataset(hub["path"], hub["name"], split=hub["splits"][split])
        return entry.get("joiner", "\n").join(ds[hub["field"]])
    except Exception:  # offline, renamed or unloadable: the caller explains what to do instead
        return None


def load_text(dataset: str, split: str = "test", data_dir: Optional[str] = None) -> tuple[str, TextSource]:
    """The whole text of `dataset` (a name or a path) for `split` ('valid' or 'test')."""
    path = Path(dataset)
    if path.suffix in (".txt", ".jsonl") or path.exists():
        if path.is_dir():
            raise DataError(f"dataset path {path} is a directory: pass a .txt or .jsonl file")
        if not path.is_file():
            raise DataError(f"dataset file {path} does not exist")
        text = _read_local(path)
        return text, TextSource(path.name, "file", str(path), len(text))
    entries = manifest()
    if dataset not in entries:
        raise DataError(
            f"unknown dataset {dataset!r}: use one of {', '.join(sorted(entries))} or a path to a .txt/.jsonl file"
        )
    entry = entries[dataset]
    if "builtin" in entry:
        topics = importlib.import_module(entry["builtin"]).topics
        keys = sorted(topics)
        # Disjoint halves, so that calibrating on 'valid' and evaluating on 'test' never share text.
        half = len(keys) // 2
        keys = keys[:half] if split in ("valid", "train") else keys[half:]
        text = entry["joiner"].join(topics[k] for k in keys)
        return text, TextSource(dataset, split, f"builtin:{entry['builtin']}", len(text))
    fname = entry["files"][split]
    local_dir = data_dir or os.environ.get(DATA_DIR_ENV)
    if local_dir:
        candidate = Path(local_dir) / fname
        if candidate.is_file():
            text = candidate.read_text(encoding="utf-8")
            return text, TextSource(dataset, split, str(candidate), len(text))
    text = _from_hub(entry, split)
    if text is not None:
        return text, TextSource(dataset, split, f"hub:{entry['hub']['path']}", len(text))
    where = f"{local_dir}/{fname}" if local_dir else f"DIR/{fname} and pass --data-dir DIR (or set {DATA_DIR_ENV}=DIR)"
    raise DataError(f"dataset {dataset!r} ({split}) is not available offline: put {fname} at {where}")


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one 1-D LongTensor of token ids, without special tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def window_sampling(num_tokens: int, n: int, seqlen: int) -> str:
    """How `calibration_windows` draws `n` windows of `seqlen` from `num_tokens` tokens, for reports and logs."""
    offsets = num_tokens - seqlen + 1
    if n * seqlen <= num_tokens:
        return "distinct, non-overlapping"
    if n <= offsets:
        return (f"distinct offsets, overlapping: the text holds {num_tokens // seqlen} non-overlapping "
                f"windows of {seqlen} tokens, not {n}")
    return f"repeated: the text has {offsets} distinct windows of {seqlen} tokens, fewer than {n}"


def calibration_windows(tokens: torch.Tensor, n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """`n` windows [n, seqlen] at seeded random offsets, drawn without replacement: non-overlapping
    where the text holds `n` of them, else at distinct (overlapping) offsets; windows repeat only when
    the text has fewer than `n` distinct offsets. The last two cases are logged (`window_sampling`)."""
    total = tokens.numel()
    if total < seqlen:
        raise DataError(
            f"the calibration text has {total} tokens, fewer than one window of {seqlen}: "
            "lower --calib-seqlen or use more text"
        )
    gen = torch.Generator().manual_seed(seed)
    if n * seqlen <= total:
        # The tokens no window takes are spread at random over the n + 1 gaps between windows.
        gaps = torch.randint(0, total - n * seqlen + 1, (n,), generator=gen).sort().values
        starts = (gaps + torch.arange(n) * seqlen)[torch.randperm(n, generator=gen)]
    else:
        offsets = total - seqlen + 1
        rounds = -(-n // offsets)  # more than one only when windows must repeat
        starts = torch.cat([torch.randperm(offsets, generator=gen) for _ in range(rounds)])[:n]
        log.warning("calibration windows: %s", window_sampling(total, n, seqlen))
    return torch.stack([tokens[s : s + seqlen] for s in starts.tolist()])


def evaluation_windows(tokens: torch.Tensor, seqlen: int, limit: Optional[int] = None) -> torch.Tensor:
    """Consecutive non-overlapping windows [k, seqlen]; the tail shorter than a window is dropped."""
    k = tokens.numel() // seqlen
    if limit is not None:
        k = min(k, limit)
    if k == 0:
        raise DataError(f"the text has {tokens.numel()} tokens, fewer than one window of {seqlen}")
    return tokens[: k * seqlen].reshape(k, seqlen)


def check_calibration(calib, config: CalibConfig) -> None:
    """Refuse calibration text that is missing, empty or too short for one window, before a model loads.

    `calib` takes `quantize()`'s forms: None (then `config.dataset`), a dataset name or path, a list of
    texts, or token windows (nothing to check). The length check is on bytes: a token of a byte-level
    or byte-fallback tokenizer covers at least one byte of UTF-8 (the leading space marker aside), so a
    text of fewer bytes cannot fill one window of `config.seqlen` tokens. Lists of texts are only
    checked for emptiness: `quantize()` shortens the window to fit them.
    """
    if isinstance(calib, torch.Tensor):
        return
    one_text = calib is None or isinstance(calib, str)
    if one_text:
        text, source = load_text(calib or config.dataset, "valid", config.data_dir)
        what = f"the calibration text {source.origin}"
    else:
        text, what = "\n\n".join(calib), f"the {len(calib)} calibration texts"
    if not text.strip():
        raise DataError(f"{what} is empty: pass a text with at least {config.seqlen} tokens (--calib-dataset)")
    size = len(text.encode("utf-8"))
    if one_text and size + 1 < config.seqlen:
        raise DataError(f"{what} has {size} bytes, too few for one window of {config.seqlen} tokens: "
                        "use more text or lower --calib-seqlen")


def load_calibration(tokenizer, dataset: str, n: int, seqlen: int, seed: int = 0, data_dir: Optional[str] = None):
    """Token windows [n, seqlen] from the 'valid' split of `dataset`, and where they came from (the
    source's `sampling` says whether the windows overlap or repeat)."""
    text, source = load_text(dataset, "valid", data_dir)
    tokens = tokenize_text(tokenizer, text)
    windows = calibration_windows(tokens, n, seqlen, seed)
    return windows, dataclasses.replace(source, sampling=window_sampling(tokens.numel(), n, seqlen))
