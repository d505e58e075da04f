"""launcher/ray_submit.sh --local, as the README gives it: a temporary head on 127.0.0.1, the job, then
only that head's processes stopped."""

import os
import sys
from pathlib import Path

from conftest import needs_ray
from raytest import local_submit

ROOT = Path(__file__).resolve().parents[2]


def test_local_submit_script_runs_a_job_and_cleans_up(tmp_path):
    needs_ray()
    # A relative interpreter path, as in `PYTHON=.venv/bin/python launcher/ray_submit.sh ...`
    done, summary = local_submit(os.path.relpath(sys.executable, ROOT), tmp_path, "script")
    assert summary["steps"] == 30 and summary["planned_by"] == ["ray"]
    assert "stopped" in done.stdout + done.stderr  # the script stopped its own head
