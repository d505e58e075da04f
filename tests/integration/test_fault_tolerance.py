"""torchrun --max-restarts + --resume auto: a rank killed mid-run (fault injection) makes torchrun
restart the group, which resumes from the last checkpoint and ends with the same final metrics as an
uninterrupted run."""

from test_torchrun import torchrun_losses


def _final(records):
    return [r for r in records if r["kind"] == "final"][-1]


def test_killed_rank_restarts_and_finishes_the_same(tmp_path, monkeypatch):
    common = ["--set", "output.checkpoint_every=10", "--set", "adaptive.enabled=true"]
    clean, _ = torchrun_losses(2, tmp_path / "clean", *common)
    monkeypatch.setenv("TORCHRUN_ARGS", "--max-restarts 2")
    marker = tmp_path / "crashed-once"
    crashed, _ = torchrun_losses(
        2,
        tmp_path / "crash",
        *common,
        "--resume",
        "auto",
        "--set",
        "fault.crash_at_step=25",
        "--set",
        "fault.crash_rank=1",
        "--set",
        f"fault.crash_once_file='{marker}'",
        "--set",
        "parallel.timeout_s=30",
    )
    assert marker.is_file(), "the fault was never injected"
    steps = [r["step"] for r in crashed if r["kind"] == "step"]
    assert steps.count(21) == 2 and steps[-1] == 80, "steps 21..25 ran twice: resumed from step 20"
    want, got = _final(clean), _final(crashed)
    assert got["step"] == want["step"] == 80
    assert got["test_accuracy"] == want["test_accuracy"]
    assert abs(got["test_loss"] - want["test_loss"]) <= 1e-5 * want["test_loss"]
    assert got["num_experts"] == want["num_experts"]
