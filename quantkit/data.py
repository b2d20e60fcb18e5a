"""Calibration and evaluation text: named datasets (ptb, wikitext2, pydoc), local .txt/.jsonl files.

Calibration samples are `n` windows of `seqlen` tokens drawn at seeded random offsets from the
tokenized text; evaluation windows are the text's consecutive non-overlapping windows.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from quantkit.config import UserError

MANIFEST_PATH = Path(__file__).resolve().parent.parent / "calib_data" / "manifest.json"
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


def manifest() -> dict:
    return json.loads(MANIFEST_PATH.read_text())


def named_datasets() -> list[str]:
    return sorted(manifest())


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


def calibration_windows(tokens: torch.Tensor, n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """`n` windows [n, seqlen] at seeded random offsets (distinct where the text allows)."""
    if tokens.numel() < seqlen + 1:
        raise DataError(
            f"the calibration text has {tokens.numel()} tokens, fewer than one window of {seqlen}: "
            "lower --calib-seqlen or use more text"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seqlen, (n,), generator=gen)
    return torch.stack([tokens[s : s + seqlen] for s in starts.tolist()])


def evaluation_windows(tokens: torch.Tensor, seqlen: int, limit: Optional[int] = None) -> torch.Tensor:
    """Consecutive non-overlapping windows [k, seqlen]; the tail shorter than a window is dropped."""
    k = tokens.numel() // seqlen
    if limit is not None:
        k = min(k, limit)
    if k == 0:
        raise DataError(f"the text has {tokens.numel()} tokens, fewer than one window of {seqlen}")
    return tokens[: k * seqlen].reshape(k, seqlen)


def load_calibration(tokenizer, dataset: str, n: int, seqlen: int, seed: int = 0, data_dir: Optional[str] = None):
    """Token windows [n, seqlen] from the 'valid' split of `dataset`, and where they came from."""
    text, source = load_text(dataset, "valid", data_dir)
    return calibration_windows(tokenize_text(tokenizer, text), n, seqlen, seed), source
