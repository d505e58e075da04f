"""launcher/ray_submit.sh --local, as the README gives it: a temporary head on 127.0.0.1, the job, then
only that head's processes stopped."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_ray
from raytest import free_port, local_submit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 60 s: a Ray head started and stopped by the script
def test_local_submit_script_runs_a_job_and_cleans_up(tmp_path):
    """Where the run's files go is said before the job starts; the job's log shows rank 0's progress (a line
    per redraw) and ends with torchrun's summary."""
    needs_ray()
    # A relative interpreter path, as in `PYTHON=.venv/bin/python launcher/ray_submit.sh ...`
    done, summary = local_submit(os.path.relpath(sys.executable, ROOT), tmp_path, "script", progress=True)
    assert summary["steps"] == 30 and summary["planned_by"] == ["ray"]
    assert "stopped" in done.stdout + done.stderr  # the script stopped its own head
    output = done.stdout + done.stderr
    assert f"dynmoe ray: the run's files go to {tmp_path / 'script'} (--storage-path/--name)" in output
    assert re.search(r"RayTrainWorker.*\b30/30 \[", output), output[-4000:]  # the progress bar, as lines
    lines = done.stdout.splitlines()
    end = lines.index(f"metrics:    {tmp_path / 'script'}/metrics.jsonl")
    assert lines[end - 2].startswith("final (step 30, ") and "test accuracy" in lines[end - 2]
    assert lines[end + 1] == f"checkpoint: {tmp_path / 'script' / 'checkpoints' / 'step_000030'}"


@pytest.mark.slow
def test_local_submit_of_a_corpus_mistake_ends_with_one_line(tmp_path):
    """A mistake only the workers see (a JSON-lines corpus without the 'text' key): the workers end without
    a restart, the driver prints one line, and the script ends on it with exit status 2 (about 80 s)."""
    needs_ray()
    from hf_tiny import corpus_lines, save_llama, save_tokenizer

    save_llama(tmp_path / "model", save_tokenizer(tmp_path / "model"))
    (tmp_path / "body.jsonl").write_text("".join(json.dumps({"body": line}) + "\n" for line in corpus_lines()))
    settings = [
        "task.name='causal-lm'",
        f"task.path='{tmp_path / 'body.jsonl'}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{tmp_path / 'model'}'",
        "model.moe_layers=[1]",
        "train.max_steps=2",
        "train.global_batch_size=4",
        "output.report=false",
    ]
    env = {**os.environ, "PYTHON": sys.executable, "RAY_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port())}
    cmd = ["sh", "launcher/ray_submit.sh", "--local", "--num-workers", "2", "--storage-path", str(tmp_path / "s")]
    cmd += [arg for setting in settings for arg in ("--set", setting)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("dynmoe-train: error:")]
    assert len(errors) == 1 and "no key 'text' (task.text_field)" in errors[0], output[-4000:]
    assert done.stdout.strip().splitlines()[-1] == errors[0] and "Traceback" not in output
    assert "failed" not in done.stdout.strip().splitlines()[-1]
