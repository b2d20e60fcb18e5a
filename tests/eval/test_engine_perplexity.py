"""Perplexity through the engine: with an unquantized pool it is the transformers model's, by the same
protocol; a quantized pool moves it (int4 more than int8), and chunked prefills read the earlier chunks'
codes exactly as one prefill reads its own."""

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
    ref = perplexity(hf, tok, **args, kv_bits=16)
    fp = engine_perplexity(model, tok, **args, kv_bits=16)
    assert fp.tokens == ref.tokens == 3 * 63 and fp.kv == "engine fp"
    assert fp.ppl == pytest.approx(ref.ppl, rel=1e-4)
    kv8 = engine_perplexity(model, tok, **args, kv_bits=8).ppl
    kv4 = engine_perplexity(model, tok, **args, kv_bits=4).ppl
    assert abs(kv8 / fp.ppl - 1) > 1e-5  # an unquantized pool would give fp's figure to float noise
    assert abs(kv8 / fp.ppl - 1) < 0.01
    # the same per-token int8 codes as the transformers path's quantized cache (runtime/kv_quant)
    assert kv8 == pytest.approx(perplexity(hf, tok, **args, kv_bits=8).ppl, rel=1e-4)
    assert abs(kv4 / fp.ppl - 1) > 2 * abs(kv8 / fp.ppl - 1)


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
    import sys

    from quantkit.cli import main

    monkeypatch.setattr(sys, "argv", ["quantkit", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_cli_eval_ppl_engine(tiny_models, text_file, monkeypatch, capsys):
    import json

    argv = ["eval", "ppl", str(tiny_models["llama"]), "--engine", "--dataset", str(text_file), "--seqlen", "32",
            "--windows", "2", "--kv-bits", "16", "--kv-bits", "8", "--device", "cpu", "--json"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code in (0, None), err
    result = json.loads(out)
    rows, (name,) = result["rows"], result["datasets"]
    assert [r["kv"] for r in rows] == ["engine fp", "engine KV8 online"]
    assert rows[0]["tokens"][name] == 2 * 31 and rows[0]["ppl"][name] != rows[1]["ppl"][name]
    code, _, err = run_cli(["eval", "ppl", str(text_file), "--engine"], monkeypatch, capsys)
    assert code == 2 and "not a model directory" in err and "Traceback" not in err
