"""Perplexity through the engine, what `eval ppl` runs by default: with an unquantized pool it is the
transformers model's, by the same protocol; a quantized pool moves it (int4 more than int8); chunked
prefills read the earlier chunks' codes exactly as one prefill reads its own; the CLI's figures are the
engine's, and `--reference` is transformers' own model."""

import json
import sys

import pytest
import torch

from quantkit.config import UserError
from quantkit.engine.model import load_decoder
from quantkit.eval.engine_perplexity import engine_perplexity
from quantkit.eval.perplexity import perplexity


@pytest.fixture(scope="module")
def decoder(tiny_models):
    model, tokenizer, _ = load_decoder(tiny_models["qwen2"], "cpu", torch.float32)
    return model, tokenizer


def test_unquantized_pool_equals_transformers_and_quantized_pools_move_it(decoder, tiny_models, text_file):
    from transformers import AutoModelForCausalLM

    model, tok = decoder
    args = dict(dataset=str(text_file), seqlen=64, windows=3, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models["qwen2"]), dtype=torch.float32).eval()
    ref = perplexity(hf, tok, **args)
    fp = engine_perplexity(model, tok, **args, kv_bits=16)
    assert fp.tokens == ref.tokens == 3 * 63 and fp.kv == "KV16"
    assert fp.ppl == pytest.approx(ref.ppl, rel=1e-4)
    kv8 = engine_perplexity(model, tok, **args, kv_bits=8)
    kv4 = engine_perplexity(model, tok, **args, kv_bits=4)
    assert (kv8.kv, kv4.kv) == ("KV8 per token", "KV4 per token, keys rotated")
    assert abs(kv8.ppl / fp.ppl - 1) > 1e-5  # an unquantized pool would give fp's figure to float noise
    assert abs(kv8.ppl / fp.ppl - 1) < 0.01
    assert abs(kv4.ppl / fp.ppl - 1) > 2 * abs(kv8.ppl / fp.ppl - 1)


def test_chunked_prefill_reads_the_same_codes(decoder, text_file):
    model, tok = decoder
    args = dict(dataset=str(text_file), seqlen=64, windows=2, progress=False, kv_bits=4)
    whole = engine_perplexity(model, tok, **args).ppl
    chunked = engine_perplexity(model, tok, **args, chunk=24).ppl  # chunks end inside blocks of 16
    assert chunked == pytest.approx(whole, rel=1e-5)


def test_window_longer_than_the_context_is_refused(decoder, text_file):
    model, tok = decoder
    with pytest.raises(UserError, match="--seqlen"):
        engine_perplexity(model, tok, str(text_file), seqlen=model.max_positions + 1, windows=1, progress=False)


def run_cli(argv, monkeypatch, capsys):
    from quantkit.cli import main

    monkeypatch.setattr(sys, "argv", ["quantkit", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_cli_eval_ppl_runs_the_engine(tiny_models, text_file, monkeypatch, capsys):
    """`eval ppl --kv-bits 4` gives the engine's KV4 figure, with its KV16 row as the reference of Δ %, KL
    and top-1; `--reference` gives transformers' figure and refuses a quantized KV cache."""
    path = tiny_models["llama"]
    common = ["--dataset", str(text_file), "--seqlen", "32", "--windows", "2", "--device", "cpu", "--json"]
    code, out, err = run_cli(["eval", "ppl", str(path), "--kv-bits", "4", *common], monkeypatch, capsys)
    assert code in (0, None), err
    result = json.loads(out)
    (name,) = result["datasets"]
    kv16, kv4 = result["rows"]
    assert (kv16["kv"], kv4["kv"]) == ("KV16", "KV4 per token, keys rotated") and kv4["tokens"][name] == 2 * 31
    model, tok, _ = load_decoder(path, "cpu")
    engine = engine_perplexity(model, tok, str(text_file), seqlen=32, windows=2, kv_bits=4, progress=False)
    assert kv4["ppl"][name] == pytest.approx(engine.ppl, rel=1e-9)
    assert kv4["delta_pct"][name] == pytest.approx(100 * (kv4["ppl"][name] / kv16["ppl"][name] - 1))
    assert kv4["kl"][name] > 0 and 0 < kv4["top1"][name] <= 1 and kv16["kl"] == {}

    code, out, err = run_cli(["eval", "ppl", str(path), "--reference", *common], monkeypatch, capsys)
    assert code in (0, None), err
    (row,) = json.loads(out)["rows"]
    assert row["kv"] == "KV16 (transformers)"
    assert row["ppl"][name] == pytest.approx(kv16["ppl"][name], rel=1e-4)
    code, _, err = run_cli(["eval", "ppl", str(path), "--reference", "--kv-bits", "4", *common], monkeypatch, capsys)
    assert code == 2 and "no quantized KV cache" in err and "Traceback" not in err
