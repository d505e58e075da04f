"""launcher/ray_submit.sh --local, as the README gives it: a temporary head on 127.0.0.1, the job, then
only that head's processes stopped."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import needs_ray
from raytest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_local_submit_script_runs_a_job_and_cleans_up(tmp_path):
    needs_ray()
    # A relative interpreter path, as in `PYTHON=.venv/bin/python launcher/ray_submit.sh ...`
    env = {
        **os.environ,
        "PYTHON": os.path.relpath(sys.executable, ROOT),
        "RAY_PORT": str(free_port()),
        "RAY_DASHBOARD_PORT": str(free_port()),
    }
    cmd = [
        "sh",
        "launcher/ray_submit.sh",
        "--local",
        "--config",
        "launcher/configs/demo.toml",
        "--num-workers",
        "2",
        "--storage-path",
        str(tmp_path),
        "--name",
        "script",
        "--set",
        "train.max_steps=30",
        "--set",
        "output.progress=false",
        "--set",
        "output.report=false",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((tmp_path / "script" / "ray_summary.json").read_text())
    assert summary["steps"] == 30 and summary["planned_by"] == ["ray"]
    assert "stopped" in done.stdout + done.stderr  # the script stopped its own head
