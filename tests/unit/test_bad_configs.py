"""Every bad config, config file and checkpoint ends `dynmoe-train` at start-up with one line naming the
option and the bad value, and exit status 2 (no traceback, no process group, no data loaded).

The table runs in-process through `cli.main` (the function the console script runs, with --print-config
so that a config that wrongly passes prints instead of training); a handful of cases run the real
command in a subprocess, one of them under launcher/torchrun.sh.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import tiny_cli_args

from dynmoe_dist.train.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = tiny_cli_args(64, 2)


def _set(*pairs):
    return [arg for pair in pairs for arg in ("--set", pair)]


# (id, command-line arguments, WORLD_SIZE or None, fragments the error line must contain)
# {tmp} is a directory holding the files made by `bad_files`.
CASES = [
    # wrong types, checked from the dataclass annotations
    ("float-given-word", _set("train.epochs=abc"), None, ["train.epochs ('abc')", "must be a number"]),
    ("int-given-float", _set("train.global_batch_size=8.5"), None, ["train.global_batch_size (8.5)", "integer"]),
    ("int-given-bool", _set("model.dim=true"), None, ["model.dim (True)", "must be an integer"]),
    ("bool-given-yes", _set("output.progress=yes"), None, ["output.progress ('yes')", "true or false"]),
    ("bool-given-int", _set("adaptive.enabled=1"), None, ["adaptive.enabled (1)", "true or false"]),
    ("list-given-string", _set("model.freeze=embeddings"), None, ["model.freeze ('embeddings')", "list of strings"]),
    (
        "list-of-ints-given-words",
        _set("model.moe_layers=['a']"),
        None,
        ["model.moe_layers (['a'])", "list of integers"],
    ),
    (
        "pair-given-three",
        _set("train.betas=[0.9, 0.99, 0.999]"),
        None,
        ["train.betas ([0.9, 0.99, 0.999])", "2 numbers"],
    ),
    ("str-given-int", _set("train.precision=16"), None, ["train.precision (16)", "must be a string"]),
    ("tuple-given-string", _set("moe.aux_losses=diverse"), None, ["moe.aux_losses ('diverse')", "list of strings"]),
    ("optional-int-given-word", _set("moe.max_experts=many"), None, ["moe.max_experts ('many')", "integer"]),
    # ranges and choices
    ("bad-choice", _set("train.precision=fp8"), None, ["train.precision ('fp8')", "float32"]),
    ("negative-steps", _set("train.max_steps=-3"), None, ["train.max_steps (-3)", ">= 0"]),
    ("moe-field-named-with-section", _set("moe.router=top_k", "moe.top_k=9"), None, ["moe.top_k (9)"]),
    ("keep-no-checkpoints", _set("output.keep_checkpoints=0"), None, ["output.keep_checkpoints (0)"]),
    # the compute budget and the balance rule (moe/balance.py)
    ("budget-above-experts", _set("moe.target_k=9"), None, ["moe.target_k (9", "num_experts (8)"]),
    ("budget-negative", _set("moe.target_k=-1"), None, ["moe.target_k (-1", "(0, num_experts (8)]"]),
    (
        "bias-without-choice-scores",
        _set("moe.router=top_p", "moe.balance=bias"),
        None,
        ["moe.balance ('bias')", "top_p"],
    ),
    ("unknown-balance", _set("moe.balance=aux"), None, ["moe.balance ('aux')", "bias"]),
    (
        "budget-below-the-fallback",
        _set("moe.target_k=0.5", "moe.train_k0=top1"),
        None,
        ["moe.target_k (0.5) < 1", "train_k0 ('top1')"],
    ),
    (
        "budget-against-calibration",
        _set("moe.target_k=1.5", "moe.calibrate_k=2"),
        None,
        ["moe.calibrate_k (2) != target_k (1.5)"],
    ),
    # task names
    ("unknown-task", _set("task.name=cifar"), None, ["task.name ('cifar')", "synthetic", "vit-mnist", "jsonl"]),
    # model shapes that cannot be built
    (
        "heads-do-not-divide-dim",
        _set("model.dim=30", "model.num_heads=4"),
        None,
        ["model.dim (30)", "model.num_heads (4)"],
    ),
    ("moe-layer-out-of-range", _set("model.moe_layers=[2]"), None, ["model.moe_layers entry (2)", "num_layers (2)"]),
    ("moe-layer-twice", _set("model.moe_layers=[1, 1]"), None, ["model.moe_layers ([1, 1])", "twice"]),
    (
        "vit-patch-does-not-tile",
        _set("task.name=vit-mnist", "model.patch_size=5"),
        None,
        ["model.patch_size (5)", "image size"],
    ),
    (
        "minilm-too-deep",
        _set("task.name=minilm-sentiment", "model.num_layers=8"),
        None,
        ["model.num_layers (8)", "6 layers"],
    ),
    ("jsonl-without-path", _set("task.name=jsonl"), None, ["task.path ('')"]),
    ("jsonl-missing-file", _set("task.name=jsonl", "task.path={tmp}/nope.jsonl"), None, ["task.path (", "nope.jsonl"]),
    # expert parallelism against the world
    ("ep-does-not-divide-world", _set("parallel.ep_size=3"), "4", ["parallel.ep_size (3)", "world size (4"]),
    ("ep-larger-than-world", _set("parallel.ep_size=8"), "4", ["parallel.ep_size (8)", "world size (4"]),
    (
        "fewer-experts-than-ep",
        _set("parallel.ep_size=4", "moe.num_experts=2"),
        "4",
        ["moe.num_experts (2) < ep_size (4)", "parallel.ep_size"],
    ),
    (
        "fewer-experts-than-world",
        _set("moe.num_experts=2"),
        "4",
        ["moe.num_experts (2) < ep_size (4)", "parallel.ep_size"],
    ),
    (
        "batch-smaller-than-world",
        _set("train.global_batch_size=6", "train.grad_accum=2"),
        "4",
        ["micro-batch size (3", "train.global_batch_size 6", "world size (4)"],
    ),
    ("bad-world-size-env", [], "two", ["WORLD_SIZE ('two')"]),
    # config files
    ("missing-file", ["--config", "{tmp}/missing.toml"], None, ["config file (", "missing.toml", "does not exist"]),
    ("unparsable-toml", ["--config", "{tmp}/garbage.toml"], None, ["config file (", "garbage.toml", "not valid TOML"]),
    ("section-not-a-table", ["--config", "{tmp}/nontable.toml"], None, ["section [train] must be a table", "3"]),
    ("unknown-section", ["--config", "{tmp}/section.toml"], None, ["unknown section [trainer]", "valid sections"]),
    ("unknown-key", ["--config", "{tmp}/key.toml"], None, ["unknown key train.learning_rate", "valid keys"]),
    ("wrong-type-in-file", ["--config", "{tmp}/type.toml"], None, ["model.num_layers ('two')", "integer"]),
    (
        "set-into-non-table",
        ["--config", "{tmp}/nontable.toml", "--set", "train.lr=1"],
        None,
        ["section [train] must be a table"],
    ),
    ("bad-set-syntax", _set("lr=1"), None, ["section.key=value", "'lr=1'"]),
    # checkpoints
    ("resume-nonexistent", _set("output.resume=/nonexistent"), None, ["output.resume ('/nonexistent')", "meta.pt"]),
    (
        "resume-dir-without-meta",
        _set("output.resume={tmp}/empty_ckpt"),
        None,
        ["output.resume (", "empty_ckpt", "meta.pt"],
    ),
]


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "garbage.toml").write_text("[train\nlr = = 3\n")
    (tmp_path / "nontable.toml").write_text("train = 3\n")
    (tmp_path / "section.toml").write_text("[trainer]\nlr = 0.1\n")
    (tmp_path / "key.toml").write_text("[train]\nlearning_rate = 0.1\n")
    (tmp_path / "type.toml").write_text('[model]\nnum_layers = "two"\n')
    (tmp_path / "empty_ckpt").mkdir()
    corrupt = tmp_path / "corrupt_ckpt"
    corrupt.mkdir()
    (corrupt / "meta.pt").write_bytes(b"not a torch file")
    return tmp_path


def _fill(args, tmp):
    return [a.replace("{tmp}", str(tmp)) for a in args]


def _check_error_line(err: str, fragments):
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("dynmoe-train: error: "), err
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


@pytest.mark.parametrize("args, world_size, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_one_line_and_exit_status_2(args, world_size, fragments, bad_files, capsys, monkeypatch):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main(_fill(args, bad_files) + ["--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed as a resolved config
    _check_error_line(captured.err, fragments)


@pytest.mark.parametrize(
    "args, option, written",
    [
        (["--config", "my_run.toml"], "config file", "my_run.toml"),
        (_set("task.name='causal-lm'", "model.source='hf'", "model.path='tiny_qwen2'"), "model.path", "tiny_qwen2"),
        (_set("task.name='jsonl'", "task.path='data/train.jsonl'"), "task.path", "data/train.jsonl"),
        (_set("output.resume='runs/x/checkpoints/step_10'"), "output.resume", "runs/x/checkpoints/step_10"),
    ],
    ids=["config", "model-path", "jsonl-path", "resume"],
)
def test_relative_paths_are_shown_as_resolved(args, option, written, tmp_path, monkeypatch, capsys):
    """Relative paths are read from the directory the command runs in; the error shows where it looked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(args + ["--print-config"]) == 2
    resolved = tmp_path.resolve() / written
    _check_error_line(
        capsys.readouterr().err,
        [f"{option} ('{written}' = {resolved})", "relative paths are read from the directory the command runs in"],
    )


def test_the_table_is_big_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def test_a_good_config_passes_the_same_path(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_set("parallel.ep_size=2", "train.epochs=3") + ["--print-config"]) == 0
    assert "epochs = 3.0" in capsys.readouterr().out  # an integer for a float option is read as a float


SUBPROCESS_CASES = [
    ("module-train", ["-m", "dynmoe_dist.train", "--set", "train.epochs=abc"], ["train.epochs ('abc')"]),
    ("module-cli", ["-m", "dynmoe_dist.train.cli", "--set", "output.progress=yes"], ["output.progress ('yes')"]),
    # the only case that has to build the trainer: the file exists, torch.load finds it corrupt
    (
        "corrupt-meta",
        ["-m", "dynmoe_dist.train", *TINY, "--set", "output.resume={tmp}/corrupt_ckpt", "--out-dir", "{tmp}/out"],
        ["corrupt_ckpt", "corrupt or unreadable"],
    ),
]


@pytest.mark.parametrize("args, fragments", [c[1:] for c in SUBPROCESS_CASES], ids=[c[0] for c in SUBPROCESS_CASES])
def test_real_command_exits_2_with_one_line(args, fragments, bad_files):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, *_fill(args, bad_files)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    _check_error_line(proc.stderr, fragments)


def test_torchrun_launcher_fails_before_any_process_group(tmp_path):
    """launcher/torchrun.sh checks the config once, as rank 0 of a 2-rank world, before starting a rank:
    one line, exit status 2 (tests/distributed/test_bad_input.py runs the mistakes a rank finds itself)."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["sh", "launcher/torchrun.sh", "2", "--set", "parallel.ep_size=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).strip() == (
        "dynmoe-train: error: parallel.ep_size (3) does not divide the world size (2)"
    )


def test_launcher_checks_in_process(capsys, monkeypatch):
    from dynmoe_dist.train import launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: python -m dynmoe_dist.train")
    assert launch.main(["two", "--set", "train.lr=0.1"]) == 2
    _check_error_line(capsys.readouterr().err, ["NPROC ('two') must be a positive number of local ranks"])
    assert launch.main(["4", "--set", "moe.num_experts=2"]) == 2
    _check_error_line(capsys.readouterr().err, ["moe.num_experts (2) < ep_size (4)"])
    assert launch.main(["2", "--set", "parallel.ep_size=2", "--print-config"]) == 0  # nothing started
    assert "ep_size = 2" in capsys.readouterr().out and "WORLD_SIZE" not in os.environ


def test_the_rank_that_failed_on_its_own_comes_first():
    from dynmoe_dist.parallel.elastic import cause_first

    # rank 1 exited with status 1; the agent then stopped rank 0 with SIGTERM within the same second
    assert list(cause_first({0: (-15, 100), 1: (1, 100)}).items()) == [(1, 1), (0, -15)]
    assert list(cause_first({0: (2, 101), 1: (2, 100)})) == [1, 0]  # both on their own: the earlier
    assert list(cause_first({1: (-9, 100), 0: (-9, 100)})) == [0, 1]  # both killed: the lower rank


def test_launcher_outcome_prints_one_line(capsys):
    from dynmoe_dist.train.launch import outcome

    errors = {1: "dynmoe-train: error: from rank 1", 0: "dynmoe-train: error: from rank 0"}
    assert outcome({1: 2, 0: 2}, errors) == 2
    assert capsys.readouterr().err == "dynmoe-train: error: from rank 0\n"  # rank 0's line when it has one
    assert outcome({1: 2, 0: -15}, {1: "dynmoe-train: error: from rank 1"}) == 2
    assert capsys.readouterr().err == "dynmoe-train: error: from rank 1\n"
    assert outcome({1: 17, 0: -15}, {}) == 1  # a crash: torchrun's status, the first rank to fail named
    assert capsys.readouterr().err == "dynmoe-train: rank 1 failed (exit status 17); its output is above\n"
    assert outcome({}, {}) == 0 and capsys.readouterr().err == ""


def test_errors_from_inside_the_run_are_one_line_too(monkeypatch, capsys):
    """A CheckpointError (a ValueError) raised while training, with a multi-line message from torch."""
    from dynmoe_dist.train import run as run_module
    from dynmoe_dist.train.checkpoint import CheckpointError

    def failing_run(config, signals=None):
        raise CheckpointError(
            "checkpoint file x/meta.pt is corrupt or unreadable: Weights only load failed.\n\n"
            "Check the documentation of torch.load"
        )

    monkeypatch.setattr(run_module, "run", failing_run)
    assert main([]) == 2
    _check_error_line(capsys.readouterr().err, ["x/meta.pt is corrupt", "failed. Check the documentation"])
    monkeypatch.setenv("DYNMOE_TRACEBACK", "1")  # the escape hatch for debugging shows the traceback
    with pytest.raises(CheckpointError):
        main([])
