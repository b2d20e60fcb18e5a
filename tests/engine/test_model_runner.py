"""ModelRunner: the context it resolves from max_model_len and the model's positions."""

from __future__ import annotations

import pytest

from quantkit.config import ConfigError
from quantkit.engine import Engine, EngineConfig


def test_max_model_len_above_the_models_positions_is_refused(tiny_models):
    """The tiny model has 256 positions (its rotary table): 257 is an error naming both numbers, not a
    context silently cut to 256; up to 256 is taken as given, unset is the model's."""
    def engine(max_model_len):
        return Engine(tiny_models["llama"], EngineConfig(device="cpu", num_kv_tokens=512, max_model_len=max_model_len))

    with pytest.raises(ConfigError, match=r"^--max-model-len 257 is more than this model supports \(256 tokens"):
        engine(257)
    shorter = engine(100)
    assert shorter.max_model_len == 100 == shorter.scheduler.max_model_len
    assert engine(None).max_model_len == 256 == engine(256).max_model_len
