"""The static-cache decode loop (CUDA-graph replay on the GPU) against transformers' generate, on the CPU."""

import pytest
import torch

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig
from quantkit.runtime.decode import Sampling, StaticDecoder, generate, sample
from quantkit.runtime.pipeline import Pipeline
from tiny import make_tiny_model, make_tokenizer


def _batch(tok, texts):
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_equal_generate(arch):
    model = make_tiny_model(arch).eval()
    tok = make_tokenizer()
    enc = _batch(tok, ["the model is small", "a"])  # different lengths: the second row is left-padded
    assert (enc["attention_mask"] == 0).any()
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=None)
        ours = generate(model, enc["input_ids"], enc["attention_mask"], 8, pad_id=tok.pad_token_id, use_graph=True)
    assert torch.equal(ours, ref)


def test_eos_stops_a_row_and_pads_it():
    model = make_tiny_model("llama").eval()
    tok = make_tokenizer()
    enc = _batch(tok, ["the model is small", "a"])
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        free = generate(model, enc["input_ids"], enc["attention_mask"], 6, pad_id=0)
        new = free[:, n:].tolist()
        # An end-of-sequence id for row 1 that row 1 first emits at step j > 0 and row 0 never emits.
        j = next(j for j in range(1, 6) if new[1][j] not in new[1][:j] and new[1][j] not in new[0] and new[1][j] != 0)
        out = generate(model, enc["input_ids"], enc["attention_mask"], 6, eos_ids=(new[1][j],), pad_id=0)
    assert torch.equal(out[0], free[0])
    assert torch.equal(out[1, : n + j + 1], free[1, : n + j + 1])
    assert (out[1, n + j + 1:] == 0).all() and out.shape == free.shape


def test_step_logits_match_a_full_forward():
    model = make_tiny_model("qwen3").eval()
    ids = torch.randint(3, 300, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(ids).logits
        dec = StaticDecoder(model, 2, 16, use_graph=False)
        got = [dec.prefill(ids[:, :5], mask[:, :5])]
        got += [dec.step(ids[:, i]) for i in range(5, 9)]
    for i, logits in enumerate(got):
        assert torch.allclose(logits, full[:, 4 + i], atol=1e-4), i


def test_first_graphed_step_warms_up_what_the_capture_will_launch(monkeypatch):
    # the eager step before a capture runs as if graphed (dispatch then compiles and loads the kernels
    # the graph will use, e.g. the Gluon GEMM that eager calls leave to the GEMV); eager decoding never
    from quantkit.kernels.capture import capturing

    model = make_tiny_model("llama").eval()
    ids = torch.randint(3, 300, (2, 5))
    seen = []
    for use_graph in (True, False):
        dec = StaticDecoder(model, 2, 16, use_graph=False)
        dec.use_graph = use_graph  # as on CUDA; only the first step runs here (no capture on the CPU)
        with torch.no_grad():
            dec.prefill(ids, torch.ones_like(ids))
            real = dec._forward
            monkeypatch.setattr(dec, "_forward", lambda *a: seen.append(capturing(torch.device("cpu"))) or real(*a))
            dec.step(ids[:, 0])
    assert seen == [True, False]
    assert not capturing(torch.device("cpu"))


def test_sampling_settings():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    assert sample(logits, Sampling()).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    assert sample(logits, Sampling(1.0, 1.0, 1), g).tolist() == [1, 0]  # top-k 1 is greedy
    assert sample(logits, Sampling(1.0, 1e-6, 0), g).tolist() == [1, 0]  # so is a tiny top-p
    draws = torch.stack([sample(logits, Sampling(1.0, 1.0, 2), g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 3}


def test_pipeline_static_loop_matches_generate(tiny_models, tmp_path):
    out = tmp_path / "q"
    quantkit.quantize(str(tiny_models["llama"]), QuantizeConfig(weight=WeightQuantConfig(4, 32)), work_dir=out,
                      progress=False)
    model, tok = quantkit.load(out, device="cpu")
    prompts = ["Hi, pls intro yourself", "上海是"]
    a = Pipeline(model, tok, cuda_graphs=False)(prompts, max_new_tokens=7)
    b = Pipeline(model, tok, cuda_graphs=True)(prompts, max_new_tokens=7)  # on the CPU: the same loop, eager
    assert [(r.text, r.generated_tokens, r.finish_reason) for r in a] == [(r.text, r.generated_tokens, r.finish_reason) for r in b]


def test_sliding_window_beyond_its_window_uses_generate():
    from quantkit.runtime.decode import fits_static_cache

    model = make_tiny_model("mistral")
    model.config.sliding_window = 16
    assert fits_static_cache(model, 16) and not fits_static_cache(model, 17)
    model.config.use_sliding_window = False  # Qwen2-style switch: the window is not used
    assert fits_static_cache(model, 17)
    assert fits_static_cache(make_tiny_model("llama"), 10_000)
