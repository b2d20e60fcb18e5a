"""Constrained decoding on CUDA: the grammars' bitmasks (filled on the host, copied from pinned memory)
applied by XGrammar's Triton kernel to logits that come out of the decode steps' CUDA graphs; constrained
and unconstrained rows in the same graphed batch."""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantkit.engine import Engine, EngineConfig, SamplingParams
from quantkit.engine.structured import StructuredOutput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "b", "c"]},
                                           "name": {"type": "string", "pattern": "^[a-z]{2,8}$"}},
          "required": ["id", "tag", "name"], "additionalProperties": False}


def test_grammars_with_cuda_graphs(small_llama):
    engine = Engine(small_llama["w4g128"], EngineConfig(cache_max_entry_count=0.05, max_num_seqs=16))
    assert engine.runner.graphs
    replays = []
    replay = engine.runner._replay
    engine.runner._replay = lambda step, bucket: replays.append(bucket) or replay(step, bucket)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = engine.generate(["the model quantizes"], free, progress=False)[0]
    constrained = [SamplingParams(max_tokens=80, temperature=t, seed=i, structured=StructuredOutput.json_schema(SCHEMA))
                   for i, t in enumerate([0.0, 1.0] * 4)]
    regex = SamplingParams(max_tokens=40, temperature=1.0, seed=9, structured=StructuredOutput.regex(r"[A-Z]{3}-\d{3}"))
    outs = engine.generate(["the model quantizes"] + [f"keys {i} and values" for i in range(9)],
                           [free] + constrained + [regex], progress=False)
    assert replays   # the decode steps ran from graphs
    assert outs[0].token_ids == alone.token_ids
    for out in outs[1:9]:
        value = json.loads(out.text)
        assert set(value) == {"id", "tag", "name"} and 0 <= value["id"] <= 999 and value["tag"] in "abc"
    assert re.fullmatch(r"[A-Z]{3}-\d{3}", outs[9].text)
