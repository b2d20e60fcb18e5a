"""The registry knows every family, and its entries match the real modules of tiny models."""

import pytest

from quantkit.models import UnsupportedArchitecture, spec_for_architecture, spec_for_config, supported_architectures
from quantkit_testing.tiny import make_tiny_model


def test_unsupported_lists_supported():
    with pytest.raises(UnsupportedArchitecture) as exc:
        spec_for_architecture("GPT2LMHeadModel")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "InternLM2ForCausalLM"):
        assert arch in str(exc.value)
    assert len(supported_architectures()) >= 5


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_entries_name_real_modules(arch):
    model = make_tiny_model(arch)
    spec = spec_for_config(model.config)
    assert spec.name == arch
    layer = model.get_submodule(spec.layers_path)[0]
    for name in spec.linears:
        assert layer.get_submodule(name).__class__.__name__ == "Linear"
    for group in spec.groups:
        layer.get_submodule(group.prev)
        layer.get_submodule(group.loss_module)
        for name in group.linears:
            assert name in spec.linears


def test_architecture_facts_are_typed_fields():
    """A misspelt fact is an error at registration, not a silently taken default."""
    from quantkit.models.registry import ArchSpec, spec_for_architecture

    with pytest.raises(TypeError, match="qkv_baias"):
        ArchSpec("typo", ("TypoForCausalLM",), qkv_baias=True)
    assert spec_for_architecture("Qwen2ForCausalLM").qkv_bias and not spec_for_architecture("LlamaForCausalLM").qkv_bias
    assert spec_for_architecture("Qwen3ForCausalLM").qk_norm
    glm = spec_for_architecture("GlmForCausalLM")
    assert glm.rope_interleaved and glm.o_proj_bias is False
    assert spec_for_architecture("LlavaForConditionalGeneration").vision
    assert "q_proj" in spec_for_architecture("LlamaForCausalLM").no_clip
