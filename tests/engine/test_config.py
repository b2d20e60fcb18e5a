"""EngineConfig's checks and SamplingParams' defaults from the model's generation config and tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from quantkit.config import ConfigError
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.sequence import Sequence


def test_the_stop_set_is_the_union_of_the_generation_configs_and_the_tokenizers_eos():
    """A chat model's generation config names its end of turn, its tokenizer the end of text: both stop."""
    both = SamplingParams().with_defaults(GenerationConfig(eos_token_id=[7, 2]), eos_token_id=9)
    assert both.eos_token_ids == [7, 2, 9]
    assert Sequence([1], both).stop_ids == {2, 7, 9}
    assert SamplingParams().with_defaults({"eos_token_id": 2}, eos_token_id=2).eos_token_ids == [2]
    assert SamplingParams().with_defaults({"eos_token_id": 7}, eos_token_id=None).eos_token_ids == [7]
    assert SamplingParams().with_defaults(None, eos_token_id=9).eos_token_ids == [9]
    assert SamplingParams().with_defaults(None).eos_token_ids == []
    # Set by the caller: neither source replaces it.
    assert SamplingParams(eos_token_ids=[5]).with_defaults({"eos_token_id": 7}, 9).eos_token_ids == [5]


@pytest.mark.parametrize("dtype", ["auto", None, "float16", "bfloat16", torch.bfloat16, torch.float32])
def test_engine_config_takes_the_dtypes_it_can_run(dtype):
    assert EngineConfig(dtype=dtype).dtype == dtype


@pytest.mark.parametrize("dtype", ["float64", "fp16", "half", torch.float64, 16])
def test_engine_config_refuses_another_dtype_in_one_line(dtype):
    with pytest.raises(ConfigError, match=r"^--dtype .* is not supported: choose auto, float16 or bfloat16\.$"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("bits", [3, 32, 0])
def test_kv_bits_outside_16_8_4_are_refused_by_the_config_and_the_pool(bits):
    """One check of the KV widths: the engine's config and a pool allocated directly say the same."""
    from quantkit.kernels.paged_kv import PagedKV

    with pytest.raises(ConfigError, match=rf"^--kv-bits {bits} is not supported: choose 16"):
        EngineConfig(kv_bits=bits)
    with pytest.raises(ConfigError, match=rf"^--kv-bits {bits} is not supported: choose 16"):
        PagedKV.allocate(1, 16, 1, 64, bits, torch.float16, "cpu")


def test_static_scales_apply_to_a_quantized_pool_only():
    assert EngineConfig(kv_bits=8, kv_scales="static").static_kv_scales
    assert not EngineConfig(kv_bits=16, kv_scales="static").static_kv_scales
    assert not EngineConfig(kv_bits=4).static_kv_scales
    EngineConfig(kv_bits=16, kv_scales="static", kv_rotation="hadamard")  # nothing static to conflict with
    with pytest.raises(ConfigError, match="--kv-rotation hadamard"):
        EngineConfig(kv_bits=4, kv_scales="static", kv_rotation="hadamard")
