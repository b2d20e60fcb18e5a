"""Checkpoint directories: safetensors shards, config.json, extra files, written atomically.

Everything goes into a temporary sibling directory that is renamed onto the target only when
complete, so an interrupted run leaves the target as it was.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from quantkit.config import UserError

SHARD_BYTES = 5 * 1024**3
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(UserError):
    """The output directory cannot be written, or a checkpoint cannot be read."""


def check_work_dir(work_dir: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory unless `overwrite`, before any work is spent."""
    if work_dir.exists() and not work_dir.is_dir():
        raise CheckpointError(f"--work-dir {work_dir} is a file; choose a directory path")
    if work_dir.is_dir() and any(work_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"--work-dir {work_dir} is not empty; choose another directory or pass --overwrite")


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    return shards


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `tensors` as one file or as shards with an index; returns the file names."""
    from safetensors.torch import save_file

    shards = _shards(tensors, shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        names.append(name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def write_checkpoint(
    work_dir: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    overwrite: bool = False,
    files: Optional[dict[str, Path]] = None,
    json_files: Optional[dict[str, dict]] = None,
    writers: Optional[list[Callable[[Path], None]]] = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a complete checkpoint directory atomically and return its path.

    `files` are copied in as they are; `json_files` are written as JSON; each of `writers` is called
    with the temporary directory (tokenizer.save_pretrained, generation config, …).
    """
    work_dir = Path(work_dir)
    check_work_dir(work_dir, overwrite)
    work_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{work_dir.name}.tmp-", dir=work_dir.parent))
    try:
        write_safetensors(tmp, tensors, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        for writer in writers or []:
            writer(tmp)
        for name, src in (files or {}).items():
            shutil.copy2(src, tmp / name)
        for name, data in (json_files or {}).items():
            (tmp / name).write_text(json.dumps(data, indent=2, default=str))
        if work_dir.exists():
            old = work_dir.with_name(f".{work_dir.name}.old-{tmp.name[-8:]}")
            work_dir.rename(old)
            tmp.rename(work_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(work_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return work_dir


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory; a truncated or corrupt file raises CheckpointError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no model*.safetensors files: it is not a quantkit checkpoint")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{f} is truncated or corrupt ({exc}); re-create the checkpoint".replace("\n", " ")) from None
    return out
