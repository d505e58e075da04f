"""`launcher/torchrun.sh` runs of the demo config on 1, 2 and 3 ranks give the same loss curve
(float32: 1e-4 relative over the first 20 steps, and the same adaptive events and expert counts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun_losses(nproc: int, out_dir: Path, *extra: str):
    env = {**os.environ, "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    cmd = [
        "sh",
        str(ROOT / "launcher" / "torchrun.sh"),
        str(nproc),
        "--config",
        str(ROOT / "launcher" / "configs" / "demo.toml"),
        "--out-dir",
        str(out_dir),
        "--set",
        "output.progress=false",
        "--set",
        "output.report=false",
        "--set",
        "output.tensorboard=false",
        # The reference losses. Under the default two, very few tokens per window select no expert, and
        # these float32 runs on 1 and on 2-3 ranks planned different adds at step 26: an add that hangs
        # on a few borderline tokens is not float32-stable across reduction orders. float64 invariance
        # through adds and removals, on the default, is tested in tests/distributed.
        "--set",
        "moe.preset='paper'",
        *extra,
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return records, done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("torchrun")
    return {n: torchrun_losses(n, base / f"n{n}") for n in (1, 2, 3)}


def _steps(records):
    return [r["loss"] for r in records if r["kind"] == "step"]


def _events(records):
    return [
        (r["step"], r["layer"], r["removed"], [a["expert"] for a in r["added"]], r["num_experts"])
        for r in records
        if r["kind"] == "event"
    ]


@pytest.mark.parametrize("nproc", [2, 3])
def test_same_loss_curve_as_one_rank(runs, nproc):
    ref, got = _steps(runs[1][0]), _steps(runs[nproc][0])
    assert len(got) == len(ref) == 80
    first = max(abs(a - b) / abs(b) for a, b in zip(got[:20], ref[:20]))
    assert first <= 1e-4, f"{nproc} ranks: {first:.2e} relative over 20 steps"
    whole = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert whole <= 1e-2, f"{nproc} ranks: {whole:.2e} relative over the whole curve"
    assert _events(runs[nproc][0]) == _events(runs[1][0]) != []


def test_summary_printed_once_with_accuracy(runs):
    stdout = runs[2][1]
    assert stdout.count("test accuracy") == 1 and "metrics:" in stdout
