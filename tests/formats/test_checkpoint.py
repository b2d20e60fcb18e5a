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
