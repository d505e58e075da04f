"""Start-up checks: warnings for options that do nothing in this run, optional extras that are missing."""

import importlib.util
import warnings

import pytest

from dynmoe_dist.config import load_config
from dynmoe_dist.tasks import TASK_OPTIONS, TASK_SPECS
from dynmoe_dist.train import startup
from dynmoe_dist.train.cli import main
from dynmoe_dist.train.startup import ConfigWarning, ignored_options, prepare_run, resolve_optional_features


def _ignored(*overrides):
    return ignored_options(load_config(None, list(overrides)))


@pytest.mark.parametrize(
    "overrides, option, why",
    [
        (["task.path='x.jsonl'"], "task.path ('x.jsonl')", "task 'synthetic' does not read it"),
        (["model.patch_size=2"], "model.patch_size (2)", "task 'synthetic'"),
        (["task.name='vit-mnist'", "task.max_len=64"], "task.max_len (64)", "task 'vit-mnist'"),
        (["task.name='minilm-sentiment'", "model.dim=384"], "model.dim (384)", "task 'minilm-sentiment'"),
        (["task.name='minilm-sentiment'", "model.ffn_dim=99"], "model.ffn_dim (99)", "task 'minilm-sentiment'"),
        (["moe.top_k=3"], "moe.top_k (3)", "only the top_k router reads it, and moe.router is 'top_any'"),
        (["moe.router='top_k'", "moe.top_p=0.7"], "moe.top_p (0.7)", "moe.router is 'top_k'"),
        (["moe.router='top_p'", "moe.threshold_init=0.1"], "moe.threshold_init (0.1)", "top_any"),
        (
            ["moe.router='top_k'", "adaptive.expert_init='average'"],
            "adaptive.expert_init ('average')",
            "only top_any layers add and remove experts",
        ),
        (["moe.router='top_k'", "moe.max_experts=12"], "moe.max_experts (12)", "only top_any layers"),
        (
            ["adaptive.enabled=false", "adaptive.replicate_factor=2.0"],
            "adaptive.replicate_factor (2.0)",
            "adaptive.enabled is false",
        ),
    ],
)
def test_an_option_that_does_nothing_is_named_with_the_reason(overrides, option, why):
    messages = _ignored(*overrides)
    assert len(messages) == 1 and messages[0].startswith(option + " has no effect: ") and why in messages[0], messages


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["moe.top_k=2"],  # set, but to the default value
        ["moe.router='top_k'", "moe.top_k=1"],  # read by the router
        ["task.name='vit-mnist'", "model.patch_size=7", "model.freeze=['patch_embed']"],
        ["task.name='minilm-sentiment'", "model.freeze=['embeddings']", "task.max_len=64"],
        ["moe.router='top_k'", "adaptive.replicate_factor=2.0"],  # re-placement/replication apply to top_k
    ],
)
def test_options_that_matter_give_no_warning(overrides):
    assert _ignored(*overrides) == []


def test_defaults_never_warn_even_when_derived():
    # max_experts is derived from num_experts (declared default None): not set by the user, not reported
    assert _ignored("moe.router='top_k'", "moe.num_experts=4") == []


def test_every_task_declares_what_it_reads():
    for name in ("synthetic", "vit-mnist", "minilm-sentiment", "jsonl"):
        reads = TASK_SPECS[name].reads
        assert reads is not None and reads <= TASK_OPTIONS, name
    assert "model.patch_size" not in TASK_SPECS["synthetic"].reads and "model.dim" not in TASK_SPECS["jsonl"].reads


def test_prepare_run_emits_config_warnings():
    with pytest.warns(ConfigWarning, match=r"moe.top_p \(0.5\) has no effect"):
        prepare_run(load_config(None, ["moe.top_p=0.5", "output.tensorboard=false", "output.report=false"]))


def _without(monkeypatch, *absent):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a))


def test_default_features_without_their_extra_turn_off_with_a_warning(monkeypatch):
    _without(monkeypatch, "tensorboard", "matplotlib")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = resolve_optional_features(load_config(None, []))
    assert not config.output.tensorboard and not config.output.report
    texts = [str(w.message) for w in caught if w.category is ConfigWarning]
    assert len(texts) == 2 and "output.tensorboard turned off: tensorboard is not installed" in texts[0]
    assert (
        "output.report turned off: matplotlib" in texts[1] and "pip install -e '.[report]' in the checkout" in texts[1]
    )


@pytest.mark.parametrize("option, package", [("output.tensorboard", "tensorboard"), ("output.report", "matplotlib")])
def test_a_feature_asked_for_by_name_fails_naming_the_extra(monkeypatch, option, package):
    _without(monkeypatch, package)
    config = load_config(None, [f"{option}=true"])
    with pytest.raises(
        ValueError,
        match=rf"{option} \(true\) needs {package}, which is not installed: "
        r"pip install -e '\.\[report\]' in the checkout",
    ):
        resolve_optional_features(config)


def test_installed_extras_change_nothing(monkeypatch):
    monkeypatch.setattr(startup, "missing_packages", lambda packages: [])
    config = load_config(None, ["output.report=true"])
    assert resolve_optional_features(config) is config


def test_cli_prints_warnings_once_on_rank0_and_fails_for_explicit_features(monkeypatch, capsys):
    _without(monkeypatch, "matplotlib")
    monkeypatch.setenv("RANK", "0")
    no_tb = ["--set", "output.tensorboard=false"]  # whether tensorboard is installed here does not matter
    assert main(no_tb + ["--set", "model.patch_size=2", "--print-config"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "dynmoe-train: warning: output.report turned off: matplotlib is not installed" in err[0]
    assert err[1].startswith("dynmoe-train: warning: model.patch_size (2) has no effect") and len(err) == 2
    monkeypatch.setenv("RANK", "1")
    assert main(no_tb + ["--set", "model.patch_size=2", "--print-config"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["--set", "output.report=true", "--print-config"]) == 2
    assert "error: output.report (true) needs matplotlib" in capsys.readouterr().err
