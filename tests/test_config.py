"""Configs validate what users set; recipes load and flags override them."""

from pathlib import Path

import pytest

from quantkit.config import ConfigError, QuantizeConfig, WeightQuantConfig, build_config, load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_awq_format_needs_4_bits():
    with pytest.raises(ConfigError, match="4-bit only"):
        QuantizeConfig(method="rtn", weight=WeightQuantConfig(5, 128), format="awq")
    with pytest.raises(ConfigError, match="4 or 8"):
        QuantizeConfig(method="rtn", weight=WeightQuantConfig(3, 128), format="compressed-tensors")


def test_default_format_by_bits():
    assert QuantizeConfig().resolved_format == "awq"
    assert QuantizeConfig(method="int8", weight=WeightQuantConfig(8, -1, True)).resolved_format == "compressed-tensors"


@pytest.mark.parametrize("bits", [1, 9])
def test_bits_range(bits):
    with pytest.raises(ConfigError):
        WeightQuantConfig(bits, 128)


def test_recipes_load_and_flags_override():
    for path in RECIPES.glob("*.yaml"):
        build_config(load_recipe(path))
    cfg = build_config(load_recipe(RECIPES / "w4g128-rtn.yaml"), **{"weight.group_size": 64, "weight.bits": None})
    assert cfg.weight.group_size == 64 and cfg.weight.bits == 4 and cfg.method == "rtn"


def test_unknown_recipe_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("method: rtn\nweight: {bitz: 4}\n")
    with pytest.raises(ConfigError, match="bitz"):
        build_config(load_recipe(p))


def test_section_overrides_merge_over_the_recipe_and_unset_flags_keep_it():
    """A section's flags come as a mapping of its fields; None keeps the recipe's value; a misspelt field is refused."""
    recipe = {"method": "awq", "weight": {"bits": 4, "group_size": 64}, "calib": {"samples": 16}}
    cfg = build_config(recipe, weight=dict(bits=None, group_size=32), calib=dict(seqlen=256, samples=None))
    assert (cfg.weight.bits, cfg.weight.group_size, cfg.calib.samples, cfg.calib.seqlen) == (4, 32, 16, 256)
    assert recipe["weight"] == {"bits": 4, "group_size": 64}  # the recipe itself is left as it was
    with pytest.raises(ConfigError, match="bitz"):
        build_config(weight=dict(bitz=4))


def test_int8_is_w8_per_channel_symmetric_unless_told_otherwise():
    assert build_config(method="int8").weight == WeightQuantConfig(8, -1, True)
    assert build_config({"weight": {"symmetric": False}}, method="int8").weight == WeightQuantConfig(8, -1, False)
    assert build_config(method="rtn").weight == WeightQuantConfig()
