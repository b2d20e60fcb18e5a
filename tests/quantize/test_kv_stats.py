"""KV statistics written by quantization runs: AWQ's own windows, nothing without calibration data."""

import json

import torch

import quantkit
from quantkit.config import build_config
from quantkit.formats.kv_stats import FILE_NAME, read_kv_stats
from quantkit.models.loading import load_fp_model

FAST = {"awq.n_grid": 4, "awq.search_tokens": 64, "calib.batch_size": 4, "weight.group_size": 32,
        "calib.samples": 4, "calib.seqlen": 32}


def test_awq_run_writes_stats_and_leaves_the_model_as_it_was(tiny_models, text_file, tmp_path):
    loaded = load_fp_model(tiny_models["qwen3"])  # fp16 on the CPU: the stats pass runs in fp32 and casts back
    res = quantkit.quantize(loaded, build_config(method="awq", **FAST), calib=str(text_file), work_dir=tmp_path / "q",
                            progress=False)
    stats = read_kv_stats(res.work_dir)
    assert stats.windows == 4 and stats.tokens == 4 * 32 and stats.k_min.shape == (2, 2, 16)
    report = json.loads((res.work_dir / "quant_report.json").read_text())
    assert report["kv_stats"]["tokens"] == 128 and "kv_stats" in report["timings_s"]
    assert all(p.dtype == torch.float16 for p in loaded.model.parameters())


def test_rtn_without_kv_calib_writes_no_stats(tiny_models, tmp_path):
    res = quantkit.quantize(str(tiny_models["llama"]), build_config(method="rtn", **{"weight.group_size": 32}),
                            work_dir=tmp_path / "q", progress=False)
    assert not (res.work_dir / FILE_NAME).exists()
    assert "kv_stats" not in json.loads((res.work_dir / "quant_report.json").read_text())


def test_key_means_are_the_mean_of_every_cached_key(tiny_models, tmp_path):
    """k_mean is each channel's mean over every token of every window, as transformers' own cache holds
    the keys; it survives the file (and a file without it reads as None, as older files do)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from quantkit.formats.kv_stats import KVStats, write_kv_stats
    from quantkit.quantize.kv_stats import collect_kv_stats

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["qwen3"]), dtype=torch.float32).eval()
    windows = torch.randint(3, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_kv_stats(model, windows, progress=False)
    keys = []
    with torch.no_grad():
        for w in windows:
            cache = DynamicCache(config=model.config)
            model(w[None], use_cache=True, cache=cache)
            keys.append(torch.stack([layer.keys[0].double() for layer in cache.layers]))  # [layers, heads, T, D]
    want = torch.cat(keys, dim=2).mean(dim=2).float()
    torch.testing.assert_close(stats.k_mean, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(read_kv_stats(write_kv_stats(stats, tmp_path / "s.safetensors")).k_mean, stats.k_mean)
    old = KVStats(stats.k_min, stats.k_max, stats.k_absmax, stats.v_min, stats.v_max, stats.v_absmax, 72, 3)
    assert read_kv_stats(write_kv_stats(old, tmp_path / "old.safetensors")).k_mean is None
