"""kernels/ and cluster/ resolve as dynmoe_dist.kernels / dynmoe_dist.cluster without an editable install:
from a plain copy of the source tree (what `ray job submit --working-dir .` uploads, or a GPU machine
running with PYTHONPATH=.), and from a regular (non-editable) install.

Each check runs a fresh interpreter with the editable install's finder removed first, so only the tree
or the installed copy under test can provide the modules.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
for name in [m for m in sys.modules if m == "dynmoe_dist" or m.startswith("dynmoe_dist.")]:
    del sys.modules[name]
import dynmoe_dist.cluster.submit, dynmoe_dist.cluster.coordinator, dynmoe_dist.kernels.grouped_gemm
print(json.dumps({m: sys.modules[m].__file__ for m in
                  ("dynmoe_dist", "dynmoe_dist.cluster.submit", "dynmoe_dist.kernels.grouped_gemm")}))
"""


def _probe(cwd: Path, pythonpath: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _source_copy(dest: Path) -> Path:
    """The tracked tree as a Ray working dir holds it (no .venv, no install metadata)."""
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__", "runs", ".cache", "build"),
    )
    return dest


@pytest.fixture(scope="module")
def regular_install(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build_src")
    src = _source_copy(build / "src")  # build from a copy: setuptools writes build/ and egg-info there
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def test_plain_source_tree_maps_kernels_and_cluster_beside_the_package(tmp_path):
    tree = _source_copy(tmp_path / "working_dir")
    files = _probe(tree)
    for name, file in files.items():
        assert Path(file).resolve().is_relative_to(tree.resolve()), (name, file)
    assert Path(files["dynmoe_dist.cluster.submit"]).parent == (tree / "cluster").resolve()


def test_regular_install_uses_its_own_copies(regular_install, tmp_path):
    files = _probe(tmp_path, str(regular_install))
    for name, file in files.items():
        assert Path(file).resolve().is_relative_to(regular_install.resolve() / "dynmoe_dist"), (name, file)


def test_working_dir_over_a_regular_install_takes_one_tree(regular_install, tmp_path):
    """Ray puts the uploaded working dir first on sys.path: every module must come from it, none mixed in
    from the installed copy."""
    tree = _source_copy(tmp_path / "working_dir")
    files = _probe(tree, str(regular_install))
    for name, file in files.items():
        assert Path(file).resolve().is_relative_to(tree.resolve()), (name, file)


SHADOW_PROBE = """
import sys
sys.path.insert(1, sys.argv[1])  # an installed package's place, after the checkout's root ('')
import kernels
import dynmoe_dist.kernels.grouped_gemm
print(kernels.ORIGIN, dynmoe_dist.kernels.grouped_gemm.grouped_mm.__module__)
"""


def test_a_bare_import_kernels_gets_the_installed_package_not_this_folder(tmp_path):
    """From the checkout's root (python -m puts it first on sys.path), transformers >= 5.25 imports
    Hugging Face's `kernels` package: it must get that one, and dynmoe_dist.kernels must stay ours. No import
    is forwarded: kernels/ has no __init__.py, so the folder is only a namespace-package candidate, which
    loses to a regular package found later on sys.path."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("ORIGIN = 'installed'\n")

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)

    done = run("-c", SHADOW_PROBE, str(site))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["installed", "dynmoe_dist.kernels.grouped_gemm"]
    # No such package anywhere (-S: no site-packages, where transformers 5.25 installs the real one): the
    # folder as an empty namespace package without a version, which transformers' availability probe (5.24
    # imports what it finds) reads as not installed; nothing of ours is executed under the wrong name.
    missing = run("-S", "-c", "import kernels; print(hasattr(kernels, '__version__'), hasattr(kernels, 'grouped_mm'))")
    assert missing.returncode == 0, missing.stderr[-3000:]
    assert missing.stdout.split() == ["False", "False"]


def test_transformers_imports_from_the_checkouts_root():
    """What the quick start does first: transformers' activations import its kernels integration, whatever
    transformers version (5.24 probes for `kernels`, 5.25 requires it)."""
    done = subprocess.run(
        [sys.executable, "-c", "import transformers.activations"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
