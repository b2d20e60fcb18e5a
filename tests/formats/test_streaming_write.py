"""Shards written from (name, tensor) pairs as they are produced: each shard goes to disk as soon as
the next tensor does not fit, and the result equals writing the same tensors as a dict."""

import json

import torch

from quantkit.formats.checkpoint import INDEX_NAME, read_safetensors, write_safetensors


def tensors():
    torch.manual_seed(0)
    return {f"layer{i}.w": torch.randn(64, 64) for i in range(5)}


def test_shards_are_written_while_the_tensors_are_produced(tmp_path):
    limit = 64 * 64 * 4 * 2  # two tensors per shard
    on_disk: list[int] = []

    def produce():
        for name, t in tensors().items():
            on_disk.append(len(list(tmp_path.glob("*.safetensors"))))
            yield name, t

    names = write_safetensors(tmp_path, produce(), shard_bytes=limit)
    # A shard is written when the tensor that no longer fits arrives: while tensor i is made, the
    # shards before the previous one are on disk (held: one shard and one tensor at most).
    assert on_disk == [0, 0, 0, 1, 1]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4 and len(set(index["weight_map"].values())) == 3
    back = read_safetensors(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors().items()) and sorted(back) == sorted(tensors())
    assert not list(tmp_path.glob(".part-*"))


def test_a_stream_and_a_dict_write_the_same_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_safetensors(a, tensors(), shard_bytes=64 * 64 * 4 * 2)
    write_safetensors(b, iter(tensors().items()), shard_bytes=64 * 64 * 4 * 2)
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    single = tmp_path / "single"
    single.mkdir()
    assert write_safetensors(single, iter(tensors().items())) == ["model.safetensors"]
    assert not (single / INDEX_NAME).exists()
