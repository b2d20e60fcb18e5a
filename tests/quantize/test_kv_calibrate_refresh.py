"""`kv_calibrate` into a compressed-tensors export refreshes vLLM's fp8 k_scale / v_scale tensors from the
new statistics (in the shard that holds them only), leaving every other tensor and file as it was."""

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import quantkit
from quantkit.formats.compressed_tensors import KV_SCALE_NAMES, kv_cache_scales
from quantkit.formats.kv_stats import read_kv_stats
from quantkit.quantize import export
from quantkit.quantize.kv_stats import kv_calibrate
from quantkit_testing.export_check import rtn_export
from quantkit_testing.tiny import make_text

SCALE_SUFFIXES = KV_SCALE_NAMES


@pytest.fixture(scope="module")
def exports(tiny_models, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("refresh")
    out = {fmt: rtn_export(tiny_models["llama"], text_file, root / fmt, fmt) for fmt in ("awq", "compressed-tensors")}
    with pytest.MonkeyPatch.context() as mp:  # shards small enough that the tiny model spans several
        mp.setattr(export, "STREAM_SHARD_BYTES", 64 * 1024)
        out["sharded"] = rtn_export(tiny_models["llama"], text_file, root / "sharded", "compressed-tensors")
    return out


@pytest.fixture(scope="module")
def other_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("other") / "other.txt"
    p.write_text(make_text(4000, 11))
    return p


def _calibrate(ckpt, text, **kw):
    return kv_calibrate(ckpt, dataset=str(text), samples=2, seqlen=48, device="cpu", progress=False, **kw)


def _file_bytes(ckpt):
    return {p.name: p.read_bytes() for p in ckpt.glob("*.safetensors")}


def _weights(ckpt):
    out = {}
    for f in ckpt.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def _check_refreshed(before, after, stats):
    scale_keys = sorted(k for k in before if k.endswith(SCALE_SUFFIXES))
    assert len(scale_keys) == 4 and set(after) == set(before)
    modules = [f"model.layers.{i}.self_attn" for i in range(2)]
    expected = kv_cache_scales(modules, stats.k_absmax, stats.v_absmax)
    assert any(not torch.equal(before[k], after[k]) for k in scale_keys)  # the new statistics give other scales
    for key in scale_keys:
        assert after[key].dtype == torch.float32 and torch.equal(after[key], expected[key])
        layer, kind = int(key.split(".")[2]), key.rpartition(".")[2][0]
        absmax = getattr(stats, f"{kind}_absmax")[layer].max().item()  # independently: largest |value| / 448
        assert after[key].item() == pytest.approx(absmax / 448.0, rel=1e-6)
    for key, t in before.items():
        if key not in scale_keys:
            assert t.dtype == after[key].dtype and torch.equal(t, after[key]), key


def test_calibrating_into_an_export_refreshes_its_fp8_kv_scales(exports, other_text, tmp_path, caplog):
    ckpt = shutil.copytree(exports["compressed-tensors"], tmp_path / "ckpt")
    before = _weights(ckpt)
    with caplog.at_level(logging.INFO, logger="quantkit.quantize.kv_stats"):
        stats, _ = _calibrate(ckpt, other_text)
    assert torch.equal(read_kv_stats(ckpt).k_absmax, stats.k_absmax)
    _check_refreshed(before, _weights(ckpt), stats)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as reader:
        assert reader.metadata() == {"format": "pt"}
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    assert "refreshed the fp8 KV scales in model.safetensors (4 k_scale/v_scale tensors)" in caplog.text
    quantkit.load(ckpt, device="cpu")  # still a loadable checkpoint


def test_only_the_shard_holding_the_scales_is_rewritten(exports, other_text, tmp_path):
    ckpt = shutil.copytree(exports["sharded"], tmp_path / "ckpt")
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    holders = {f for k, f in weight_map.items() if k.endswith(SCALE_SUFFIXES)}
    assert len(set(weight_map.values())) > 1 and len(holders) == 1
    files, before = _file_bytes(ckpt), _weights(ckpt)
    stats, _ = _calibrate(ckpt, other_text)
    _check_refreshed(before, _weights(ckpt), stats)
    after = _file_bytes(ckpt)
    assert sorted(after) == sorted(files)
    assert [f for f in files if files[f] != after[f]] == sorted(holders)


def test_output_elsewhere_and_awq_exports_leave_the_weights_alone(exports, other_text, tmp_path):
    ckpt = shutil.copytree(exports["compressed-tensors"], tmp_path / "ct")
    files, report = _file_bytes(ckpt), (ckpt / "quant_report.json").read_text()
    _calibrate(ckpt, other_text, output=tmp_path / "stats.safetensors")
    assert _file_bytes(ckpt) == files and (ckpt / "quant_report.json").read_text() == report

    awq = shutil.copytree(exports["awq"], tmp_path / "awq")
    files, old = _file_bytes(awq), read_kv_stats(awq)
    stats, _ = _calibrate(awq, other_text)
    assert not torch.equal(stats.k_absmax, old.k_absmax) and torch.equal(read_kv_stats(awq).k_absmax, stats.k_absmax)
    assert _file_bytes(awq) == files
