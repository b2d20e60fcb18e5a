"""The one pass of `quantize()`: block by block from the checkpoint's files, packed as it goes.

Its output is compared with the whole-model paths it replaced (same bits), its memory behaviour
is watched through the block loader, and its KV statistics are compared with a full-model pass."""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.config import build_config
from quantkit.formats.checkpoint import read_safetensors
from quantkit.formats.kv_stats import read_kv_stats
from quantkit.models import lazy
from quantkit.models.loading import load_fp_model
from quantkit.quantize.kv_stats import collect_kv_stats
from quantkit_testing.in_memory import awq_quantize, checkpoint_tensors, rtn_quantize

AWQ_FAST = {"awq.n_grid": 4, "awq.search_tokens": 64, "calib.batch_size": 4, "weight.group_size": 32,
            "calib.samples": 8, "calib.seqlen": 32}


def windows(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"method": "rtn", "weight.group_size": 32}),
    ("qwen3", {"method": "int8", "format": "compressed-tensors", "weight.bits": 8, "weight.group_size": -1,
               "weight.symmetric": True}),
    ("internlm2", {"method": "rtn", "weight.group_size": 32}),
])
def test_rtn_stream_writes_the_bits_of_the_whole_model_path(tiny_models, tmp_path, arch, overrides):
    overrides = dict(overrides)
    config = build_config(method=overrides.pop("method"), format=overrides.pop("format", None), **overrides)
    res = quantkit.quantize(str(tiny_models[arch]), config, work_dir=tmp_path / "q", progress=False)
    fp = load_fp_model(tiny_models[arch])  # the whole fp16 model, as quantize() loaded it before
    want = checkpoint_tensors(fp.model, rtn_quantize(fp.model, fp.spec, config.weight), config)
    assert_same_tensors(read_safetensors(res.work_dir), want)


def test_awq_stream_from_files_equals_the_in_memory_passes(tiny_models, text_file):
    config = build_config(method="awq", **AWQ_FAST)
    streamed = quantkit.quantize(str(tiny_models["qwen2"]), config, calib=windows(), progress=False).tensors
    # The same model in memory: through quantize() (blocks resident) and through the whole-model
    # AWQ call whose codes are packed at the end (the path quantize() used to take).
    resident = quantkit.quantize(load_fp_model(tiny_models["qwen2"]), config, calib=windows(), progress=False).tensors
    fp = load_fp_model(tiny_models["qwen2"])
    qweights = awq_quantize(fp.model, fp.spec, config, windows(), {}, progress=False)
    whole = checkpoint_tensors(fp.model, qweights, config)
    assert_same_tensors(streamed, whole)
    assert_same_tensors(resident, whole)


def test_blocks_are_read_one_at_a_time_and_released(tiny_models, tmp_path, monkeypatch):
    """At every block read, no other block holds weights; after the run none does."""
    seen: list[tuple[int, list[int]]] = []
    models = []
    load = lazy.LazyBlocks.load

    def watching_load(self, index, layer):
        layers = models[0].get_submodule(self.layers_path)
        resident = [i for i, m in enumerate(layers) if any(p.device.type != "meta" for p in m.parameters())]
        seen.append((index, resident))
        load(self, index, layer)

    build = lazy.build_lazy_model

    def keep_model(*a, **k):
        model, blocks = build(*a, **k)
        models.append(model)
        # Before any pass: every block is empty (meta), the embeddings are real.
        layers = model.get_submodule(blocks.layers_path)
        assert all(p.device.type == "meta" for p in layers.parameters())
        assert model.get_input_embeddings().weight.device.type == "cpu"
        return model, blocks

    monkeypatch.setattr(lazy.LazyBlocks, "load", watching_load)
    monkeypatch.setattr(lazy, "build_lazy_model", keep_model)
    config = build_config(method="awq", **AWQ_FAST)
    quantkit.quantize(str(tiny_models["llama"]), config, calib=windows(), work_dir=tmp_path / "q", progress=False)
    assert seen == [(0, []), (1, [])]
    layers = models[0].get_submodule("model.layers")
    assert all(p.device.type == "meta" for p in layers.parameters())


@pytest.mark.parametrize("method", ["awq", "rtn"])
def test_streamed_kv_stats_equal_a_full_pass_over_the_quantized_model(tiny_models, text_file, tmp_path, method):
    """The statistics gathered block by block equal `collect_kv_stats` over the in-memory model as
    quantize() leaves it (computing what the checkpoint holds), on the same windows."""
    loaded = load_fp_model(tiny_models["qwen3"], dtype=torch.float32)  # qwen3: k_norm before rotary
    config = build_config(method=method, **({**AWQ_FAST} if method == "awq" else {"weight.group_size": 32}))
    calib = windows(20, 32, seed=5)
    kw = {"calib": calib} if method == "awq" else {"kv_calib": calib}
    res = quantkit.quantize(loaded, config, work_dir=tmp_path / "q", progress=False, **kw)
    got = read_kv_stats(res.work_dir)
    want = collect_kv_stats(loaded.model, calib[:16], progress=False)
    assert got.tokens == want.tokens == 16 * 32 and got.windows == 16
    for name in ("k_min", "k_max", "k_absmax", "v_min", "v_max", "v_absmax", "k_mean"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-5)
    # The fp model's statistics differ: the stats really are the quantized model's.
    fp = load_fp_model(tiny_models["qwen3"], dtype=torch.float32)
    assert not torch.allclose(collect_kv_stats(fp.model, calib[:16], progress=False).k_absmax, got.k_absmax,
                              rtol=1e-4, atol=1e-5)
