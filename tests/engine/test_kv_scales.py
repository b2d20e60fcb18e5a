"""Static KV scales in the engine: a checkpoint's calibration statistics become each layer's per-head
scales, the pool stores them for every token written, perplexity stays close to fp KV, and a missing
or mismatched statistics file is a one-line error before any weight is read."""

from __future__ import annotations

import shutil

import pytest
import torch

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.formats.kv_stats import KVStats, KVStatsError, read_kv_stats, write_kv_stats
from quantkit.kernels.paged_kv import static_scales


@pytest.fixture(scope="module")
def with_stats(tiny_models, text_file, tmp_path_factory):
    """A copy of the tiny Llama with quantkit/kv_stats.safetensors measured on the test text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.quantize.kv_stats import collect_kv_stats

    out = tmp_path_factory.mktemp("with_stats") / "llama"
    shutil.copytree(tiny_models["llama"], out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(out))(text_file.read_text(), add_special_tokens=False)["input_ids"]
    write_kv_stats(collect_kv_stats(hf, torch.tensor(ids[:256]).reshape(4, 64), progress=False), out)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_pool_writes_the_static_scales(with_stats, bits):
    engine = Engine(with_stats, EngineConfig(device="cpu", num_kv_tokens=256, kv_bits=bits, kv_scales="static"))
    out = engine.generate([[5, 9, 31, 7, 100, 42, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    stats = read_kv_stats(with_stats)
    written = 7 + 5  # the prompt and the generated tokens but the last (sampled, never written)
    for i, layer in enumerate(engine.model.model.layers):
        cache = layer.self_attn.attn.kv_cache
        want = static_scales(stats.k_min[i], stats.k_max[i], stats.v_min[i], stats.v_max[i], bits)
        by_slot = [t.reshape(-1, cache.kv_heads) for w in ("k", "v") for t in cache.by_slot(w)[1:]]  # scales, zeros
        used = by_slot[0][:, 0] > 0  # the slots written (the pool starts zeroed)
        assert int(used.sum()) == written
        for got, w in zip(by_slot, want):
            assert (got[used] == w).all()
        assert not by_slot[2][~used].any()


def test_static_perplexity_is_close_to_fp_and_not_online(with_stats, text_file):
    from quantkit.engine.model import load_decoder
    from quantkit.eval.engine_perplexity import engine_perplexity

    model, tok, _ = load_decoder(with_stats, "cpu", torch.float32)
    args = dict(dataset=str(text_file), seqlen=64, windows=3, progress=False)
    fp = engine_perplexity(model, tok, **args).ppl
    online = engine_perplexity(model, tok, **args, kv_bits=8).ppl
    stats = str(with_stats / "quantkit" / "kv_stats.safetensors")
    static = engine_perplexity(model, tok, **args, kv_bits=8, kv_scales="static", kv_stats=stats)
    assert static.kv == "KV8 static per head"
    assert static.ppl != online and abs(static.ppl / fp - 1) > 1e-6 and abs(static.ppl / fp - 1) < 0.02


def test_missing_statistics_fail_before_loading(tiny_models, monkeypatch):
    import quantkit.engine.model as model_module

    monkeypatch.setattr(model_module, "load_decoder", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(KVStatsError, match="kv-calibrate"):
        Engine(tiny_models["llama"], EngineConfig(device="cpu", kv_bits=8, kv_scales="static"))
    with pytest.raises(Exception, match="online or static"):
        EngineConfig(kv_scales="dynamic")


def test_statistics_of_another_model_are_refused(with_stats, tmp_path):
    t = torch.randn(1, 3, 4)
    other = write_kv_stats(KVStats(t, t + 1, t.abs(), t, t + 1, t.abs(), tokens=8, windows=1), tmp_path / "o.safetensors")
    with pytest.raises(KVStatsError, match="recalibrate"):
        Engine(with_stats, EngineConfig(device="cpu", num_kv_tokens=64, kv_bits=8, kv_scales="static",
                                        kv_stats=str(other)))


def test_cli_eval_ppl_static(with_stats, tiny_models, text_file, monkeypatch, capsys):
    import json
    import sys

    from quantkit.cli import main

    def run(argv):
        monkeypatch.setattr(sys, "argv", ["quantkit", *argv])
        with pytest.raises(SystemExit) as exc:
            main()
        captured = capsys.readouterr()
        return exc.value.code, captured.out, captured.err

    base = ["--dataset", str(text_file), "--seqlen", "32", "--windows", "1",
            "--device", "cpu", "--kv-bits", "8", "--kv-scales", "static"]
    code, out, err = run(["eval", "ppl", str(with_stats), *base, "--json"])
    assert code in (0, None), err
    assert [r["kv"] for r in json.loads(out)["rows"]] == ["KV16", "KV8 static per head"]
    code, _, err = run(["eval", "ppl", str(tiny_models["llama"]), *base])
    assert code == 2 and "kv-calibrate" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_key_centres_load_with_the_model(with_stats, tmp_path, caplog):
    """load_decoder gives every attention layer the means of its calibrated key channels; a rotated pool
    subtracts them, which leaves the logits as they were (exact at KV16); statistics of another shape are
    logged and skipped."""
    from quantkit_testing.decoder_check import engine_logits, make_prompts
    from quantkit.engine.kv_scales import key_centers
    from quantkit.engine.model import load_decoder

    model, _, _ = load_decoder(with_stats, "cpu", torch.float32)
    stats = read_kv_stats(with_stats)
    for layer, want, mean in zip(model.model.layers, key_centers(stats), stats.k_mean):
        assert torch.equal(layer.self_attn.attn.k_center, want) and torch.equal(want, mean)
    stats.k_mean = None  # statistics written before means were recorded: the ranges' midpoints
    assert all(torch.equal(c, (lo + hi) / 2) for c, lo, hi in zip(key_centers(stats), stats.k_min, stats.k_max))
    prompts, decode = make_prompts()
    with torch.no_grad():
        centred = engine_logits(model, prompts, decode, "hadamard")
        plain = engine_logits(model, prompts, decode, "none")
    for c_seq, p_seq in zip(centred, plain):
        for c, p in zip(c_seq, p_seq):
            torch.testing.assert_close(c, p, rtol=1e-4, atol=1e-4)

    other = shutil.copytree(with_stats, tmp_path / "other")
    t = torch.randn(1, 3, 4)
    write_kv_stats(KVStats(t, t + 1, t.abs(), t, t + 1, t.abs(), tokens=8, windows=1), other)
    model, _, _ = load_decoder(other, "cpu", torch.float32)
    assert all(layer.self_attn.attn.k_center is None for layer in model.model.layers)
    assert "not centred" in caplog.text
