"""Checkpoint writing is atomic, refuses non-empty directories, shards, and reads back or fails clearly."""

import json

import pytest
import torch

from quantkit.formats.checkpoint import CheckpointError, read_safetensors, write_checkpoint


def tensors():
    torch.manual_seed(0)
    return {f"layer{i}.w": torch.randn(64, 64) for i in range(4)}


def test_write_and_read_back(tmp_path):
    out = write_checkpoint(tmp_path / "ckpt", tensors(), {"a": 1}, json_files={"r.json": {"x": 2}})
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    back = read_safetensors(out)
    for k, v in tensors().items():
        assert torch.equal(back[k], v)
    # No temporary directory is left beside it.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_shards_with_index(tmp_path):
    out = write_checkpoint(tmp_path / "ckpt", tensors(), {}, shard_bytes=64 * 64 * 4 * 2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert set(read_safetensors(out)) == set(tensors())


def test_refuses_non_empty_and_keeps_it(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="--overwrite"):
        write_checkpoint(target, tensors(), {})
    assert (target / "precious.txt").read_text() == "keep me"
    write_checkpoint(target, tensors(), {}, overwrite=True)
    assert not (target / "precious.txt").exists()


def test_failure_midway_leaves_nothing(tmp_path):
    def boom(d):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path / "ckpt", tensors(), {}, writers=[boom])
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_names_the_file(tmp_path):
    out = write_checkpoint(tmp_path / "ckpt", tensors(), {})
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        read_safetensors(out)


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_dirs_of_dead_writers_are_removed(tmp_path):
    import os
    import socket

    host = socket.gethostname()
    stale = tmp_path / f".ckpt.tmp-{host}-{dead_pid()}-0123abcd"  # a run killed mid-write
    stale_old = tmp_path / f".other.old-{host}-{dead_pid()}-89abcdef"  # killed while replacing a target
    live = tmp_path / f".ckpt.tmp-{host}-{os.getpid()}-deadbeef"  # a writer still running
    remote = tmp_path / f".ckpt.tmp-otherhost-{dead_pid()}-feedf00d"  # a writer on another host
    for d in (stale, stale_old, live, remote):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    write_checkpoint(tmp_path / "ckpt", tensors(), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name, remote.name])


def test_temp_dir_names_its_writer(tmp_path):
    import os
    import socket

    seen = []
    write_checkpoint(tmp_path / "ckpt", tensors(), {}, writers=[lambda d: seen.append(d.name)])
    assert seen[0].startswith(f".ckpt.tmp-{socket.gethostname()}-{os.getpid()}-")


@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_modes_follow_the_umask(tmp_path, umask, dir_mode, file_mode):
    import os
    import stat

    old = os.umask(umask)
    try:
        out = write_checkpoint(tmp_path / "ckpt", tensors(), {"a": 1}, json_files={"r.json": {}},
                               shard_bytes=64 * 64 * 4 * 2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    files = list(out.iterdir())
    assert len(files) == 5  # two shards, the index, config.json, r.json
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: file_mode for p in files}


def test_overwrite_leaves_no_old_copy_even_for_odd_names(tmp_path):
    target = tmp_path / "run.tmp-1"  # a target whose own name looks like a temporary one
    write_checkpoint(target, tensors(), {"v": 1})
    write_checkpoint(target, tensors(), {"v": 2}, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["run.tmp-1"]
    assert json.loads((target / "config.json").read_text()) == {"v": 2}
