"""Checkpoint directories: safetensors shards, config.json, extra files, written atomically.

Everything goes into a temporary sibling directory that is renamed onto the target only when
complete, so an interrupted run leaves the target as it was. The temporary directory is named after
the writer's host and process: a run killed mid-write (SIGKILL runs no cleanup) leaves it behind, and
the next write into the same folder removes it once that process is gone (`remove_stale_temp_dirs`).
Files and folders get the modes the umask gives (0644 / 0755 usually), like any file the user writes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import torch

from quantkit.config import UserError

SHARD_BYTES = 5 * 1024**3
INDEX_NAME = "model.safetensors.index.json"

log = logging.getLogger(__name__)

# .NAME.tmp-HOST-PID-RANDOM (being written) and .NAME.old-HOST-PID-RANDOM (the target being replaced)
_TEMP_NAME = re.compile(r"^\..+\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


class CheckpointError(UserError):
    """The output directory cannot be written, or a checkpoint cannot be read."""


def check_work_dir(work_dir: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory unless `overwrite`, before any work is spent."""
    if work_dir.exists() and not work_dir.is_dir():
        raise CheckpointError(f"--work-dir {work_dir} is a file; choose a directory path")
    if work_dir.is_dir() and any(work_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"--work-dir {work_dir} is not empty; choose another directory or pass --overwrite")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove the temporary directories in `parent` whose writer, a process of this host, is gone;
    returns them. Those of live writers and of other hosts sharing the folder are left alone."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    host = socket.gethostname()
    for p in parent.iterdir():
        m = _TEMP_NAME.match(p.name)
        if m and p.is_dir() and m["host"] == host and not _process_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s, left by an interrupted run (process %s is gone)", p, m["pid"])
            removed.append(p)
    return removed


def temp_dir_for(work_dir: Path) -> Path:
    """A new hidden sibling of `work_dir` to write into, named after this host and process (so a later
    run can tell a dead writer's leftovers); stale ones of dead writers are removed first."""
    work_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(work_dir.parent)
    tmp = work_dir.with_name(f".{work_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def set_umask_modes(directory: Path) -> None:
    """Give `directory` and everything in it the modes a new folder / file gets under the umask
    (safetensors writes its files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for p in directory.rglob("*"):
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def write_safetensors(directory: Path, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `tensors` as one file or as shards with an index; returns the file names.

    `tensors` may be a mapping or an iterable of (name, tensor) pairs produced while the file is
    written (a block-by-block quantization pass): each shard is written as soon as it is full, and
    only its tensors are held, so the whole checkpoint is never in memory at once. A shard is cut
    before the tensor that would take it past `shard_bytes`."""
    from safetensors.torch import save_file

    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    parts: list[tuple[Path, list[str], int]] = []  # written part file, its tensor names, their bytes
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        part = directory / f".part-{len(parts) + 1:05d}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append((part, list(shard), size))
        shard.clear()

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t.contiguous()
        size += nbytes
    if shard or not parts:
        flush()
    if len(parts) == 1:
        parts[0][0].rename(directory / "model.safetensors")
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, (part, keys, _) in enumerate(parts, 1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        part.rename(directory / name)
        names.append(name)
        weight_map.update({key: name for key in keys})
    total = sum(p[2] for p in parts)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def write_checkpoint(
    work_dir: Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config: dict,
    overwrite: bool = False,
    files: Optional[dict[str, Path]] = None,
    json_files: Optional[dict[str, dict]] = None,
    writers: Optional[list[Callable[[Path], None]]] = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a complete checkpoint directory atomically and return its path.

    `files` are copied in as they are; `json_files` are written as JSON; each of `writers` is called
    with the temporary directory (tokenizer.save_pretrained, generation config, …). `tensors` are
    consumed first, so a producer of (name, tensor) pairs may still complete `config`, the JSON
    files and what the writers write while it runs.
    """
    work_dir = Path(work_dir)
    check_work_dir(work_dir, overwrite)
    tmp = temp_dir_for(work_dir)
    try:
        write_safetensors(tmp, tensors, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        for writer in writers or []:
            writer(tmp)
        for name, src in (files or {}).items():
            shutil.copy2(src, tmp / name)
        for name, data in (json_files or {}).items():
            (tmp / name).write_text(json.dumps(data, indent=2, default=str))
        set_umask_modes(tmp)
        if work_dir.exists():
            prefix, _, writer = tmp.name.rpartition(".tmp-")
            old = work_dir.with_name(f"{prefix}.old-{writer}")
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
