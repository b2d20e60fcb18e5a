"""pipeline(): batch generation with token counts, finish reasons and settings."""

import pytest

import quantkit
from quantkit.config import QuantizeConfig, WeightQuantConfig


@pytest.fixture(scope="module")
def pipe(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe") / "q"
    quantkit.quantize(str(tiny_models["llama"]), QuantizeConfig(weight=WeightQuantConfig(4, 32)), work_dir=out, progress=False)
    return quantkit.pipeline(out, device="cpu")


def test_batch_of_prompts(pipe):
    responses = pipe(["Hi, pls intro yourself", "上海是"], max_new_tokens=6)
    assert len(responses) == 2
    for r in responses:
        assert r.prompt_tokens > 0
        assert r.generated_tokens <= 6
        assert r.finish_reason in ("stop", "length")
        assert isinstance(r.text, str)
    # Greedy decoding is deterministic.
    assert [r.text for r in pipe(["Hi, pls intro yourself", "上海是"], max_new_tokens=6)] == [r.text for r in responses]


def test_length_and_sampling(pipe):
    r = pipe("the model", max_new_tokens=3, temperature=0.8, top_p=0.9, top_k=20)[0]
    assert r.generated_tokens <= 3
    long = pipe("the model", max_new_tokens=12)[0]
    if long.finish_reason == "length":
        assert long.generated_tokens == 12


def test_stop_string_cuts_text(pipe):
    full = pipe("the model", max_new_tokens=12)[0]
    if len(full.text) > 4:
        stop = full.text[2:4]
        cut = pipe("the model", max_new_tokens=12, stop=[stop])[0]
        assert stop not in cut.text and cut.finish_reason == "stop"


def test_prompt_past_the_context_is_refused(pipe):
    from quantkit.config import UserError

    context = pipe.model.config.max_position_embeddings
    with pytest.raises(UserError, match=f"prompt 2 has .* tokens, the model's context is {context}"):
        pipe(["hi", "the model " * context], max_new_tokens=1)
    prompt = "the model " * 10
    n = len(pipe.tokenizer(prompt)["input_ids"])
    with pytest.raises(UserError, match=f"with --max-new-tokens {context - n + 1} .* use --max-new-tokens {context - n} or less"):
        pipe(prompt, max_new_tokens=context - n + 1)
    r = pipe(prompt, max_new_tokens=context - n)[0]  # up to the last position: accepted
    assert r.prompt_tokens == n
