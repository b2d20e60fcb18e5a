"""The export's config.json carries the rotary settings in both transformers 5's and transformers 4's keys."""

from transformers import LlamaConfig

from quantkit.quantize.export import add_legacy_rope_keys


def test_legacy_rope_keys_round_trip():
    source = LlamaConfig(rope_theta=5e5, max_position_embeddings=16384,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg = source.to_dict()
    add_legacy_rope_keys(cfg)
    # what a transformers-4 reader looks at
    assert cfg["rope_theta"] == 5e5
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["factor"] == 8.0 and "rope_theta" not in cfg["rope_scaling"]
    # and transformers 5 reads the same settings back
    assert LlamaConfig(**cfg).rope_parameters == source.rope_parameters


def test_default_rope_writes_only_the_base():
    cfg = LlamaConfig(rope_theta=1e6).to_dict()
    add_legacy_rope_keys(cfg)
    assert cfg["rope_theta"] == 1e6
    assert cfg.get("rope_scaling") is None
