"""Constrained decoding in the engine: each constrained row of a batch follows its own grammar (JSON schema,
regex, choice, EBNF), unconstrained rows give the tokens they give alone, log-probabilities stay the
model's own, preempted sequences keep their place in their grammar, and a bad grammar is refused when
the request is added."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from quantkit.config import UserError
from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.structured import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from quantkit_testing.tiny import write_tiny_model

    return write_tiny_model("llama", tmp_path_factory.mktemp("structured") / "llama")


def _engine(path, **settings) -> Engine:
    return Engine(str(path), EngineConfig(device="cpu", num_kv_tokens=settings.pop("num_kv_tokens", 2048), **settings))


def test_mixed_batch(model_dir):
    engine = _engine(model_dir)
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    alone = engine.generate(["the model"], free, progress=False)[0]
    cases = [
        (StructuredOutput.json_schema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (StructuredOutput.regex(r"[a-z]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", t)),
        (StructuredOutput.choice(["yes", "no", "上海"]), lambda t: t in ("yes", "no", "上海")),
        (StructuredOutput.grammar('root ::= "<" [0-9] ("," [0-9])? ">"'), lambda t: re.fullmatch(r"<\d(,\d)?>", t)),
        (StructuredOutput.json_object(), lambda t: t.startswith("{")),
    ]
    params = [SamplingParams(max_tokens=80, temperature=t, seed=i, structured=g, logprobs=2)
              for i, (g, _) in enumerate(cases) for t in (0.0, 1.0)]
    outs = engine.generate(["the model"] + ["keys and values"] * len(params), [free] + params, progress=False)
    assert outs[0].token_ids == alone.token_ids   # the constrained rows' masks touched no other row
    for out, (grammar, check) in zip(outs[1:], [c for c in cases for _ in (0, 1)]):
        if grammar.kind == "json_object" and out.finish_reason == "length":
            continue   # any JSON object may be long: only that it starts as one is checked
        assert out.finish_reason == "stop" and check(out.text), (grammar.kind, out.text)
    # Log-probabilities are the model's own: the first token's top-2 under a grammar are those of the
    # unconstrained distribution of the same prompt.
    raw = engine.generate(["keys and values"], SamplingParams(max_tokens=1, temperature=0, logprobs=2),
                          progress=False)[0]
    got, want = outs[1].logprobs[0].top, raw.logprobs[0].top
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


def test_grammar_survives_preemption(model_dir):
    """A pool too small for the batch: sequences are preempted and recomputed, and still end where their
    grammar does."""
    engine = _engine(model_dir, num_kv_tokens=128, block_size=16)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=StructuredOutput.json_schema(SCHEMA))
              for i in range(8)]
    outs = engine.generate([f"the cache {i} keeps" for i in range(8)], params, progress=False)
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_grammar_ends_without_an_end_token(model_dir):
    """ignore_eos and no stop token: the request ends when its grammar is complete, its text whole."""
    engine = _engine(model_dir)
    out = engine.generate(["the"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  structured=StructuredOutput.choice(["quantized", "cached"])),
                          progress=False)[0]
    assert out.finish_reason == "stop" and out.text in ("quantized", "cached")


@pytest.mark.parametrize("grammar", [StructuredOutput.regex("(a"), StructuredOutput.json_schema('{"type": "nope"}'),
                                     StructuredOutput.grammar("root ::= missing"),
                                     StructuredOutput.json_schema("{not json")])
def test_bad_grammar_is_refused_at_add(model_dir, grammar):
    engine = _engine(model_dir)
    with pytest.raises(UserError, match="structured output|not valid JSON"):
        engine.add_request("the model", SamplingParams(max_tokens=4, structured=grammar))
    assert not engine.has_unfinished_requests()
