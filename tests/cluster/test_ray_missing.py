"""Without Ray, every Ray path fails with a message naming the extra to install (no Ray cluster needed)."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from raytest import DEMO, ROOT

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.groups import single_process

HINT = "pip install -e '.[ray]' in the checkout"
pytestmark = pytest.mark.ray


def _hide_ray(monkeypatch):
    """`import ray` (and any ray.*) raises ImportError, and find_spec('ray') says it is not there."""
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "ray", None)


def test_submit_entry_point_without_ray_names_the_extra(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated: Ray is not installed')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "dynmoe_dist.cluster.submit", "--config", DEMO, "--num-workers", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert HINT in done.stderr and "simulated: Ray is not installed" in done.stderr


def test_submit_main_without_ray_names_the_extra(monkeypatch, capsys):
    _hide_ray(monkeypatch)
    from dynmoe_dist.cluster import submit

    assert submit.main(["--config", str(ROOT / DEMO), "--num-workers", "2"]) == 2
    assert HINT in capsys.readouterr().err


def _trainer_stub():
    return SimpleNamespace(config=load_config(None, ["parallel.coordinator='ray'"]), groups=single_process())


def test_ray_coordinator_without_ray_names_the_extra(monkeypatch):
    _hide_ray(monkeypatch)
    from dynmoe_dist.train.run import make_coordinator

    with pytest.raises(ValueError, match=re.escape(HINT)):
        make_coordinator(_trainer_stub())


def test_ray_coordinator_outside_the_ray_entry_point_names_it():
    pytest.importorskip("ray")
    from dynmoe_dist.train.run import make_coordinator

    with pytest.raises(ValueError, match="needs the Ray job entry point: python -m dynmoe_dist.cluster.submit"):
        make_coordinator(_trainer_stub())
