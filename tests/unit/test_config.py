"""Run configuration: TOML + --set overrides, unknown keys, validation, help text, digest."""

from typing import List, Optional, Tuple

import pytest

from dynmoe_dist.config import RunConfig, load_config, options_help, parse_override
from dynmoe_dist.moe.config import conforms, describe


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 0.5\nglobal_batch_size = 8\n[moe]\nrouter = "top_k"\ntop_k = 1\n')
    cfg = load_config(str(path), ["train.lr=0.25", "model.moe_layers=[0, 1]", "task.name=synthetic"])
    assert cfg.train.lr == 0.25 and cfg.train.global_batch_size == 8
    assert cfg.moe.router == "top_k" and cfg.model.moe_layers == [0, 1] and cfg.task.name == "synthetic"


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["adaptive.expert_init=average", "train.betas=[0.8, 0.9]"])
    path = tmp_path / "again.toml"
    path.write_text(cfg.to_toml())
    again = load_config(str(path))
    assert again.to_dict() == cfg.to_dict() and again.digest() == cfg.digest()


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key train\.lrr; valid keys of \[train\]: epochs, .*lr"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ValueError, match=r"unknown section \[trian\]"):
        load_config(None, ["trian.lr=1"])
    with pytest.raises(ValueError, match="section.key=value"):
        parse_override("lr=1")


@pytest.mark.parametrize(
    "override, message",
    [
        ("adaptive.window_start=0.7", r"window fractions \(0.7, 0.6666"),
        ("adaptive.replicate_factor=1.0", r"replicate_factor \(1.0\)"),
        ("adaptive.expert_init=copy", r"expert_init \('copy'\)"),
        ("train.global_batch_size=0", r"global_batch_size \(0\)"),
        ("moe.max_experts=2", r"max_experts \(2\) < num_experts \(8\)"),
        ("moe.min_experts=9", r"min_experts \(9\) > num_experts \(8\)"),
        ("parallel.ep_size=-1", r"ep_size \(-1\)"),
    ],
)
def test_bad_values_name_field_and_value(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("key", ["swiglu_alpha", "swiglu_limit"])
def test_the_gpt_oss_clamp_is_read_from_the_checkpoint_never_from_a_run_file(key):
    with pytest.raises(ValueError, match=rf"moe\.{key} is taken from the model \(the gpt-oss checkpoint's config\)"):
        load_config(None, [f"moe.{key}=2.0"])
    assert key not in RunConfig().to_toml()


def test_the_native_router_is_a_run_option_with_no_losses_of_ours(tmp_path):
    from hf_tiny import save_moe_checkpoint

    directory, _ = save_moe_checkpoint("olmoe", tmp_path / "olmoe")
    imported = ["task.name='causal-lm'", "model.source='hf'", f"model.path='{directory}'"]
    cfg = load_config(None, [*imported, "task.path='rotten-tomatoes'", "moe.router='native'"])
    assert cfg.moe.router == "native" and cfg.moe.aux_losses == ()  # no top-any preset applies


def test_help_lists_every_option_with_meaning():
    text = options_help()
    assert "train.lr = 0.001" in text and "Peak learning rate" in text
    assert "moe.router = 'top_any'" in text and "adaptive.expert_init" in text


def test_digest_ignores_output_section():
    a, b = RunConfig(), load_config(None, ["output.out_dir=elsewhere"])
    assert a.digest() == b.digest()
    assert a.digest() != load_config(None, ["train.lr=0.5"]).digest()


@pytest.mark.parametrize(
    "value, annotation, ok",
    [
        (3, int, True),
        (True, int, False),
        (3.0, int, False),
        (3, float, True),
        (2.5, float, True),
        (False, float, False),
        ("2", float, False),
        (True, bool, True),
        (1, bool, False),
        ("yes", bool, False),
        ("x", str, True),
        (1, str, False),
        ([1, 2], List[int], True),
        ([1, "2"], List[int], False),
        ("a", List[str], False),
        ([], List[str], True),
        ([0.9, 1], Tuple[float, float], True),
        ([0.9], Tuple[float, float], False),
        (["a", "b"], Tuple[str, ...], True),
        (None, Optional[int], True),
        (4, Optional[int], True),
        ("4", Optional[int], False),
        (None, int | None, True),
        ("x", int | None, False),
    ],
)
def test_value_types_follow_the_annotation(value, annotation, ok):
    assert conforms(value, annotation) is ok


def test_type_descriptions_and_unsupported_annotations():
    assert [describe(a) for a in (int, float, bool, List[str], Tuple[float, float], Optional[Tuple[str, ...]])] == [
        "an integer",
        "a number",
        "true or false",
        "a list of strings",
        "a list of 2 numbers",
        "a list of strings",
    ]
    with pytest.raises(TypeError, match="not supported"):
        conforms({}, dict)


def test_ints_for_float_options_become_floats_and_keys_are_recorded(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nepochs = 3\n")
    cfg = load_config(str(path), ["moe.top_p=1"])
    assert isinstance(cfg.train.epochs, float) and isinstance(cfg.moe.top_p, float)
    assert cfg.explicit == {"train.epochs", "moe.top_p"} and RunConfig().explicit == frozenset()
