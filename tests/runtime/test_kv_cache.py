"""The quantized KV cache: real memory savings, bounded error, decode equivalence, wiring into load/pipeline."""

import pytest
import torch

import quantkit
from quantkit.config import ConfigError, QuantizeConfig, WeightQuantConfig
from quantkit.formats.kv_stats import FILE_NAME, KVStatsError, read_kv_stats
from quantkit.quantize.kv_stats import collect_kv_stats
from quantkit.runtime.kv_cache import (
    KVCacheFactory,
    KVCacheSettings,
    QuantizedKVCache,
    attach_kv_cache,
    cache_arg_name,
    kv_cache_factory,
)
from tiny import make_tiny_model


class _Cfg:
    """The few config fields the factory reads: SmolLM2-like heads (3 KV heads of 64 dims)."""

    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 9, 3, 576


def _states(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 3, tokens, 64, generator=g) * 2
    k[..., 5] += 15  # an outlier key channel
    return k, torch.randn(1, 3, tokens, 64, generator=g)


@pytest.mark.parametrize("bits,limit", [(8, 0.53), (4, 0.30)])
def test_cache_memory_at_4096_tokens_is_really_smaller(bits, limit):
    cache = KVCacheFactory(_Cfg, KVCacheSettings(bits))()
    k, v = _states(4096)
    for layer in range(2):
        cache.update(k, v, layer)
    fp16 = 2 * 2 * k.numel() * 2  # K and V, two layers, two bytes each
    assert cache.dense_nbytes() == fp16
    held = [t for lay in cache.layers for s in (lay.k_stream, lay.v_stream)
            for t in [*s.parts.values(), *([s.residual] if getattr(s, "residual", None) is not None else [])]]
    assert cache.nbytes() == sum(t.numel() * t.element_size() for t in held)  # scales and zeros included
    assert cache.nbytes() / fp16 <= limit
    assert cache.get_seq_length() == 4096


@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_read_back_error_is_bounded_and_earlier_tokens_stay(bits):
    cache = KVCacheFactory(_Cfg, KVCacheSettings(bits, key_group=0))()
    k, v = _states(40)
    k1, _ = cache.update(k[:, :, :30], v[:, :, :30], 0)
    k2, v2 = cache.update(k[:, :, 30:], v[:, :, 30:], 0)
    assert torch.equal(k2[:, :, :30], k1)  # codes once written never change
    for x, y in ((k, k2), (v, v2)):
        step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / (2**bits - 1)
        err = (x - y).abs()
        assert torch.all(err <= step * 0.501 + 1e-6) and err.max() > 0


def test_int4_keys_per_channel_groups_and_full_precision_remainder():
    cache = KVCacheFactory(_Cfg, KVCacheSettings(4, key_group=16))()
    k, v = _states(40)
    out, _ = cache.update(k[:, :, :20], v[:, :, :20], 0)
    assert torch.equal(out, k[:, :, :20])  # read before coding: a group is coded once complete
    out, _ = cache.update(k[:, :, 20:], v[:, :, 20:], 0)
    stream = cache.layers[0].k_stream
    assert stream.parts["scale"].shape == (1, 3, 2, 64) and stream.residual.shape[-2] == 8
    assert torch.equal(out[:, :, 32:], k[:, :, 32:])
    for g in range(2):
        x, y = k[:, :, 16 * g:16 * (g + 1)], out[:, :, 16 * g:16 * (g + 1)]
        step = (x.amax(-2, keepdim=True).clamp(min=0) - x.amin(-2, keepdim=True).clamp(max=0)) / 15
        assert torch.all((x - y).abs() <= step * 0.501 + 1e-6)
    # The outlier channel gets its own step: the other channels are far finer than per-token int4 keys.
    per_token = KVCacheFactory(_Cfg, KVCacheSettings(4, key_group=0))().layers[0].update(k, v)[0]
    assert (out[..., :32, :] - k[..., :32, :]).pow(2).mean() < 0.5 * (per_token - k)[..., :32, :].pow(2).mean()


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 8)])
def test_chunked_forward_equals_token_by_token_decode(bits, group):
    model = make_tiny_model("llama")
    factory = attach_kv_cache(model, None, bits, key_group=group)
    assert factory.chunk == (group or None)
    name = cache_arg_name(model)
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    step = group or 24
    with torch.no_grad():
        fp = model(ids, use_cache=False).logits
        cache = factory()
        chunked = torch.cat([model(ids[:, s:s + step], use_cache=True, **{name: cache}).logits
                             for s in range(0, 24, step)], 1)
        cache = factory()
        steps = torch.cat([model(ids[:, i:i + 1], use_cache=True, **{name: cache}).logits for i in range(24)], 1)
    err = (chunked - fp).abs().max()
    assert err > 1e-5  # the forward really reads quantized K/V
    assert (chunked - steps).abs().max() < 0.25 * err  # and what it reads is what decoding would read


def test_cache_bookkeeping_crop_and_batch_ops():
    cache = KVCacheFactory(_Cfg, KVCacheSettings(4, key_group=4))()
    k, v = _states(10)
    k, v = torch.cat([k, -k]), torch.cat([v, v])
    cache.update(k, v, 0)
    assert cache.get_seq_length() == 10 and cache.layers[0].get_mask_sizes(3) == (13, 0)
    cache.crop(-4)  # cuts into the second key group, which goes back to full precision
    ks = cache.layers[0].k_stream
    assert cache.get_seq_length() == 6 and ks.parts["q"].shape[-2] == 4 and ks.residual.shape[-2] == 2
    assert cache.layers[0].v_stream.parts["q"].shape[-2] == 6
    cache.reorder_cache(torch.tensor([1, 0]))
    keys, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert keys.shape == (2, 3, 7, 64) and torch.allclose(keys[0, :, :6], -keys[1, :, :6], atol=0.5)
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.layers[0].v_stream.parts["q"].shape[0] == 1 and ks.residual.shape[0] == 1


def test_bad_settings_are_user_errors():
    with pytest.raises(ConfigError, match="--kv-bits 3"):
        KVCacheSettings(3)
    with pytest.raises(KVStatsError, match="kv-calibrate"):
        KVCacheSettings(8, "static")


@pytest.fixture(scope="module")
def checkpoint(tiny_models, text_file, tmp_path_factory):
    cfg = QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32))
    out = tmp_path_factory.mktemp("kv") / "ckpt"
    return quantkit.quantize(str(tiny_models["llama"]), cfg, work_dir=out, progress=False, kv_calib=str(text_file)).work_dir


def test_quantize_writes_stats_that_match_the_cache_states(checkpoint):
    import json

    stats = read_kv_stats(checkpoint)
    assert (checkpoint / FILE_NAME).is_file() and stats.k_min.shape == (2, 2, 16)
    assert torch.all(stats.k_min <= stats.k_max)
    assert torch.equal(stats.k_absmax, torch.maximum(stats.k_min.abs(), stats.k_max.abs()))
    assert json.loads((checkpoint / "quant_report.json").read_text())["kv_stats"]["layers"] == 2
    # Independent check: ranges read off transformers' own DynamicCache for one window.
    from transformers import DynamicCache

    model = make_tiny_model("llama")
    ids = torch.randint(3, 320, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(ids, use_cache=True, **{cache_arg_name(model): dyn})
    mine = collect_kv_stats(model, ids, progress=False)
    assert torch.allclose(mine.k_max[1], dyn.layers[1].keys[0].amax(1))
    assert torch.allclose(mine.v_min[0], dyn.layers[0].values[0].amin(1))


def test_load_and_pipeline_use_the_quantized_cache(checkpoint):
    model, tok = quantkit.load(checkpoint, device="cpu", kv_bits=4, kv_scales="static")
    assert kv_cache_factory(model).settings.describe() == "KV4 static"
    ids = tok("the cache keeps keys", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, QuantizedKVCache) and cache.get_seq_length() == ids.shape[1] + 2
    pipe = quantkit.pipeline(checkpoint, kv_bits=8, device="cpu")  # on the engine: its paged pool holds int8
    assert all(layer.self_attn.attn.kv_cache.bits == 8 for layer in pipe.engine.model.model.layers)
    assert pipe(["the model"], max_new_tokens=4)[0].generated_tokens > 0
    with pytest.raises(ConfigError):
        quantkit.load(checkpoint, device="cpu", kv_bits=3)
