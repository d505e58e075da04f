"""moe.preset: named DynMoE settings that fill in what the user did not set (top-any runs only)."""

import pytest

from dynmoe_dist.config import field_docs, load_config, with_preset
from dynmoe_dist.moe.config import DEFAULT_PRESET, PRESETS, MoEConfig

FOUR = ("diverse", "simple", "load_balance", "efficiency")


def test_default_preset_is_the_project_choice():
    config = load_config(None, [])
    assert (config.moe.preset, config.moe.aux_losses, config.adaptive.expert_init) == (
        DEFAULT_PRESET,
        ("diverse", "simple"),
        "reuse_discarded",
    )
    assert config.adaptive.min_unrouted_share == 0.0  # the reference growth rule (docs/results.md)
    assert "moe.aux_losses" not in config.explicit  # a preset's value is not the user's
    assert load_config(None, ["moe.preset='paper'"]).moe.aux_losses == FOUR


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads_and_sets_its_values(name):
    config = load_config(None, [f"moe.preset='{name}'"])
    for option, value in PRESETS[name].items():
        section, key = option.split(".")
        assert getattr(getattr(config, section), key) == value, option


def test_paper_v1_has_the_original_two_losses_and_the_user_wins():
    assert load_config(None, ["moe.preset='paper-v1'"]).moe.aux_losses == ("diverse", "simple")
    mine = load_config(None, ["moe.preset='paper-v1'", "moe.aux_losses=['diverse']", "adaptive.expert_init='average'"])
    assert (mine.moe.aux_losses, mine.adaptive.expert_init) == (("diverse",), "average")
    assert mine.moe.eval_k0 == "top1"  # the rest still comes from the preset


def test_preset_leaves_the_baselines_alone():
    top_k = load_config(None, ["moe.preset='paper-v1'", "moe.router='top_k'"])
    assert top_k.moe.aux_losses == ("switch",)  # the router's default, not the preset's DynMoE losses


def test_unknown_preset_names_the_option_and_the_value():
    with pytest.raises(ValueError, match=r"moe.preset \('v2'\) must be one of \('paper', 'paper-v1', 'project'\)"):
        load_config(None, ["moe.preset='v2'", "moe.router='top_k'"])
    with pytest.raises(ValueError, match=r"preset \('v2'\)"):
        MoEConfig(preset="v2")


def test_with_preset_does_not_change_its_input():
    data = {"moe": {"preset": "paper-v1"}}
    filled = with_preset(data)
    assert data == {"moe": {"preset": "paper-v1"}} and filled["adaptive"]["expert_init"] == "reuse_discarded"


def test_help_names_the_presets():
    doc = field_docs(MoEConfig)["preset"]
    assert all(name in doc for name in PRESETS)
