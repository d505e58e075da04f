"""Fixtures of the Ray tests: one local head per test module, one torchrun reference run per session."""

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest
from raytest import SETTINGS, start_head, torchrun


def needs_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install -e '.[ray]' in the checkout)")


@pytest.fixture(scope="module")
def ray_head():
    """A head on 127.0.0.1 with 2 CPUs, shared by the tests of a module and stopped after them."""
    needs_ray()
    nodes = start_head()
    try:
        yield nodes
    finally:
        try:
            nodes.stop()
        finally:
            shutil.rmtree(nodes.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def reference_run():
    """metrics.jsonl folder of the test config on 2 torchrun ranks (the collective coordinator)."""
    folder = Path(tempfile.mkdtemp(prefix="dynmoe-ref-"))
    try:
        torchrun(folder / "run", SETTINGS)
        yield folder / "run"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
