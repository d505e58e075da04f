"""Run configuration: TOML + --set overrides, unknown keys, validation, help text, digest."""

import pytest

from dynmoe_dist.config import RunConfig, load_config, options_help, parse_override


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


@pytest.mark.parametrize("override, message", [
    ("adaptive.window_start=0.7", r"window fractions \(0.7, 0.6666"),
    ("adaptive.replicate_factor=1.0", r"replicate_factor \(1.0\)"),
    ("adaptive.expert_init=copy", r"expert_init \('copy'\)"),
    ("train.global_batch_size=0", r"global_batch_size \(0\)"),
    ("moe.max_experts=2", r"max_experts \(2\) < num_experts \(8\)"),
    ("moe.min_experts=9", r"min_experts \(9\) > num_experts \(8\)"),
    ("parallel.ep_size=-1", r"ep_size \(-1\)"),
])
def test_bad_values_name_field_and_value(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_help_lists_every_option_with_meaning():
    text = options_help()
    assert "train.lr = 0.001" in text and "Peak learning rate" in text
    assert "moe.router = 'top_any'" in text and "adaptive.expert_init" in text


def test_digest_ignores_output_section():
    a, b = RunConfig(), load_config(None, ["output.out_dir=elsewhere"])
    assert a.digest() == b.digest()
    assert a.digest() != load_config(None, ["train.lr=0.5"]).digest()
