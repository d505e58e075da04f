"""`launcher/torchrun.sh 2` of the tiny upcycled HF LLaMA (float64, adaptive events that remove and add
experts, expert parallelism over both ranks) logs the per-step losses, events and expert counts of a
1-process `python -m dynmoe_dist.train` run of the same settings (1e-9 relative)."""

import sys
from pathlib import Path

import pytest
from hf_tiny import STEPS, changes, hf_settings, train, write_tiny_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_torchrun")
    settings = hf_settings(*write_tiny_run(root))
    one = train([sys.executable, "-m", "dynmoe_dist.train"], root / "one", settings)
    two = train(["sh", str(ROOT / "launcher" / "torchrun.sh"), "2"], root / "two", settings + ["parallel.ep_size=2"])
    return one, two


def test_torchrun_two_ranks_matches_one_process(runs):
    one, two = runs
    ref = [r["loss"] for r in one if r["kind"] == "step"]
    got = [r["loss"] for r in two if r["kind"] == "step"]
    assert len(ref) == len(got) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-9, f"largest relative loss difference {worst:.3g}"
    events = changes(one)
    assert any(e[2] for e in events) and any(e[3] for e in events), "the run was meant to remove and add experts"
    assert changes(two) == events
    assert [r["num_experts"] for r in two if r["kind"] == "step"] == [
        r["num_experts"] for r in one if r["kind"] == "step"
    ]
    final_one, final_two = (next(r for r in rs if r["kind"] == "final") for rs in runs)
    assert abs(final_two["test_loss"] - final_one["test_loss"]) <= 1e-9 * final_one["test_loss"]
