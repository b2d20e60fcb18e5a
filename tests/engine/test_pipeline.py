"""quantkit.pipeline() on the engine: batch generation with token counts, finish reasons and settings."""

import pytest

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig


@pytest.fixture(scope="module")
def pipe(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe") / "q"
    quantkit.quantize(str(tiny_models["llama"]), QuantizeConfig(weight=WeightQuantConfig(4, 32)), work_dir=out, progress=False)
    return quantkit.pipeline(out, device="cpu")


def test_batch_of_prompts(pipe):
    responses = pipe(["Hi, pls intro yourself", "上海是"], max_new_tokens=6, temperature=0)
    assert len(responses) == 2
    for r in responses:
        assert r.prompt_tokens > 0
        assert r.generated_tokens <= 6
        assert r.finish_reason in ("stop", "length")
        assert isinstance(r.text, str)
    # Greedy decoding is deterministic (the default is the model's generation_config.json: sampling here).
    again = pipe(["Hi, pls intro yourself", "上海是"], max_new_tokens=6, temperature=0)
    assert [r.text for r in again] == [r.text for r in responses]


def test_length_and_sampling(pipe):
    r = pipe("the model", max_new_tokens=3, temperature=0.8, top_p=0.9, top_k=20)[0]
    assert r.generated_tokens <= 3
    long = pipe("the model", max_new_tokens=12, temperature=0)[0]
    if long.finish_reason == "length":
        assert long.generated_tokens == 12


def test_stop_string_cuts_text(pipe):
    full = pipe("the model", max_new_tokens=12, temperature=0)[0]
    if len(full.text) > 4:
        stop = full.text[2:4]
        cut = pipe("the model", max_new_tokens=12, temperature=0, stop=[stop])[0]
        assert stop not in cut.text and cut.finish_reason == "stop"


def test_prompt_past_the_context_is_refused(pipe):
    from quantkit.config import UserError

    context = pipe.engine.max_model_len
    with pytest.raises(UserError, match="prompt 2: the prompt has .* tokens but a sequence may hold at most"):
        pipe(["hi", "the model " * context], max_new_tokens=1)
    assert not pipe.engine.has_unfinished_requests()  # prompt 1 was not left queued
    prompt = "the model " * 10
    n = len(pipe.tokenizer(prompt)["input_ids"])
    r = pipe(prompt, max_new_tokens=context, ignore_eos=True)[0]  # the engine stops at the context: "length"
    assert r.prompt_tokens == n and r.generated_tokens == context - n and r.finish_reason == "length"


def test_engine_pipeline_settings_chat_messages_and_stream(tiny_models):
    from quantkit.engine import EngineConfig

    pipe = quantkit.pipeline(tiny_models["llama"], EngineConfig(kv_bits=8, num_kv_tokens=512), device="cpu")
    assert pipe.engine.config.kv_bits == 8 and pipe.engine.config.num_kv_tokens == 512
    assert pipe.engine.model.model.layers[0].self_attn.attn.kv_cache.bits == 8
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model"}]
    whole = pipe([messages], max_new_tokens=8, ignore_eos=True, temperature=0)[0]
    assert whole.generated_tokens == 8 and len(whole.token_ids) == 8 and whole.finish_reason == "length"
    parts = list(pipe.stream(messages, max_new_tokens=8, ignore_eos=True, temperature=0))
    assert "".join(p.text for p in parts) == whole.text
    assert sum((p.token_ids for p in parts), []) == whole.token_ids
    with pytest.raises(TypeError, match="unknown sampling setting 'max_length'"):
        pipe("hi", max_length=3)
