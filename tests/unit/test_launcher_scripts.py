"""The launcher scripts as a newcomer types them: they find the project's .venv without an activated
environment (an explicit PYTHON= still wins), and a mistake in the config is one line and exit status 2
before anything starts; `ray job submit`'s failure report is cut after the job's error line."""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dynmoe_dist.cluster import relay

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = '#!/bin/sh\necho "{name} $*"\n'


def _fake_checkout(tmp_path, with_venv=True):
    """launcher/ copied into an empty tree, with a .venv whose python only says how it was called."""
    shutil.copytree(ROOT / "launcher", tmp_path / "launcher")
    if with_venv:
        _executable(tmp_path / ".venv" / "bin" / "python", FAKE_PYTHON.format(name="venv-python"))
    return tmp_path


def _executable(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _fresh_shell(*command, cwd, **env):
    """`env -i`: no activated environment, no PYTHON, only a PATH without the project's interpreter."""
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), **env}
    return subprocess.run(
        ["env", "-i", *[f"{k}={v}" for k, v in clean.items()], *command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_torchrun_script_uses_the_projects_venv(tmp_path):
    tree = _fake_checkout(tmp_path)
    done = _fresh_shell("sh", "launcher/torchrun.sh", "2", "--config", "x.toml", cwd=tree)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "venv-python -m dynmoe_dist.train.launch 2 --config x.toml"
    # from another directory too: the .venv is found beside the script, not in the current directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _fresh_shell("sh", str(tree / "launcher" / "torchrun.sh"), "1", cwd=elsewhere)
    assert done.stdout.strip() == "venv-python -m dynmoe_dist.train.launch 1"


def test_an_explicit_python_wins_and_python3_is_the_fallback(tmp_path):
    tree = _fake_checkout(tmp_path)
    mine = _executable(tmp_path / "mine" / "python", FAKE_PYTHON.format(name="my-python"))
    done = _fresh_shell("sh", "launcher/torchrun.sh", "2", cwd=tree, PYTHON=str(mine))
    assert done.stdout.strip() == "my-python -m dynmoe_dist.train.launch 2"
    bare = _fake_checkout(tmp_path / "bare", with_venv=False)
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "python3", FAKE_PYTHON.format(name="path-python3"))
    done = _fresh_shell("sh", "launcher/torchrun.sh", "2", cwd=bare, PATH=f"{bin_dir}:/usr/bin:/bin")
    assert done.stdout.strip() == "path-python3 -m dynmoe_dist.train.launch 2"


def test_ray_submit_checks_the_config_before_starting_anything(tmp_path):
    """No head is started and nothing is submitted for a config mistake: one line, exit status 2."""
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["sh", "launcher/ray_submit.sh", "--local", "--num-workers", "2", "--set", "parallel.ep_size=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip() == (
        "dynmoe-train: error: parallel.ep_size (3) does not divide the world size (2)"
    )


RAY_FAILURE = [
    "INFO cli.py:351 -- Tailing logs until the job exits (disable with --no-wait):\n",
    "(RayTrainWorker pid=1) dynmoe_dist.data: tokenising task.path ...\n",
    "dynmoe-train: error: corpus.jsonl:1: no key 'text' (task.text_field); keys: ['body']\n",
    "ERR cli.py:75 -- Job 'raysubmit_x' failed\n",
    "INFO cli.py:89 -- Status message: Job entrypoint command failed with exit code 2, last available logs:\n",
    "dynmoe-train: error: corpus.jsonl:1: no key 'text' (task.text_field); keys: ['body']\n",
]


def test_relay_stops_after_the_jobs_error_line():
    out = io.StringIO()
    found = relay.relay(iter(RAY_FAILURE), out)
    assert found == RAY_FAILURE[2].strip()
    assert out.getvalue() == "".join(RAY_FAILURE[:3])  # Ray's failure report is not repeated
    out = io.StringIO()
    assert relay.relay(iter(["a\n", "b\n"]), out) is None and out.getvalue() == "a\nb\n"


def test_relay_exit_status(capsys):
    assert relay.main(["sh", "-c", "echo start; echo 'dynmoe-train: error: bad'; echo report; exit 1"]) == 2
    assert capsys.readouterr().out == "start\ndynmoe-train: error: bad\n"
    assert relay.main(["sh", "-c", "echo crashed; exit 1"]) == 1  # no error line: Ray's status, all output
    assert capsys.readouterr().out == "crashed\n"
    assert relay.main(["sh", "-c", "echo done"]) == 0
