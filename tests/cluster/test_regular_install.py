"""`ray job submit --working-dir .` with a regular (non-editable) install of dynmoe_dist: the job's
dynmoe_dist, dynmoe_dist.cluster and dynmoe_dist.kernels resolve from the uploaded tree, with no
editable-install finder to help (slow: copies the virtualenv and builds a wheel)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_ray
from raytest import local_submit

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]


def test_ray_job_with_a_regular_install(tmp_path):
    needs_ray()
    venv = tmp_path / "venv"
    shutil.copytree(Path(sys.prefix), venv, symlinks=True)
    python = venv / "bin" / "python"
    for args in (
        ["uninstall", "-q", "-y", "dynmoe_dist"],
        ["install", "-q", "--no-deps", "--no-build-isolation", str(ROOT)],
    ):
        done = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "show", "-f", "dynmoe_dist"], capture_output=True, text=True)
    assert "dynmoe_dist/cluster/submit.py" in listed.stdout and "__editable__" not in listed.stdout
    _, summary = local_submit(str(python), tmp_path / "runs", "regular", timeout_s=600)
    assert summary["steps"] == 30 and summary["planned_by"] == ["ray"]
