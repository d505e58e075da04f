"""Clean stops and checkpoints by default, the parts that need no second process: the votes every rank
sums, the signal handlers (rank and launcher), the one-line texts, metrics readers after a resume, and
checkpoint retention. The real SIGINT / SIGTERM runs are in tests/integration/test_stop_resume.py."""

import json
import os
import signal

import pytest

from dynmoe_dist.config import OutputConfig, load_config
from dynmoe_dist.parallel import elastic
from dynmoe_dist.train import checkpoint as ckpt
from dynmoe_dist.train import control
from dynmoe_dist.train.adaptive import WindowSchedule
from dynmoe_dist.train.cli import resume_command, stop_line
from dynmoe_dist.train.notices import checkpoint_line, unreachable_window_line
from dynmoe_dist.train.telemetry import latest_attempt, read_metrics


# -- the votes ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_rank0_alone_votes_a_checkpoint_by_time_and_the_sum_decides_for_all(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(control.time, "monotonic", clock)
    out = OutputConfig(checkpoint_every=0, checkpoint_minutes=2.0)
    rank0, rank1 = control.StepControl(out, True), control.StepControl(out, False)
    clock.now += 119
    assert rank0.votes() == [0.0, 0.0]
    clock.now += 2  # 121 s since the start: rank 0's clock says due; rank 1's never votes
    summed = [a + b for a, b in zip(rank0.votes(), rank1.votes())]
    assert summed == [0.0, 1.0]
    assert rank0.decide(summed, 7) == rank1.decide(summed, 7) == control.Decision(checkpoint=True, stop=False)
    rank0.saved(7)
    assert rank0.votes() == [0.0, 0.0] and rank0.last_saved_step == 7


def test_steps_rule_needs_no_vote_and_any_rank_can_ask_to_stop():
    out = OutputConfig(checkpoint_every=5, checkpoint_minutes=0.0)
    ranks = [control.StepControl(out, rank == 0) for rank in range(3)]
    ranks[2].signals.signum = signal.SIGTERM  # only rank 2 got the signal
    summed = [sum(v) for v in zip(*(r.votes() for r in ranks))]
    assert summed == [1.0, 0.0]
    assert {repr(r.decide(summed, 4)) for r in ranks} == {repr(control.Decision(checkpoint=False, stop=True))}
    assert ranks[0].decide([0.0, 0.0], 10) == control.Decision(checkpoint=True, stop=False)


# -- the rank's handlers ------------------------------------------------------------------------------
def test_first_signal_asks_a_stop_the_same_one_twice_counts_once_a_later_one_exits(monkeypatch):
    clock, exits = Clock(), []
    monkeypatch.setattr(control.time, "monotonic", clock)
    monkeypatch.setattr(control.os, "_exit", exits.append)
    signals = control.StopSignals()
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a job started in the background
    with signals.installed():
        assert signal.getsignal(signal.SIGINT) == signals._handle
        signals._handle(signal.SIGINT, None)
        assert signals.requested and signals.signum == signal.SIGINT and exits == []
        clock.now += 0.5  # the group's signal and the launcher's forwarded copy
        signals._handle(signal.SIGINT, None)
        assert exits == []
        clock.now += 2.0  # Ctrl-C again: a hard stop, with the first signal's status
        signals._handle(signal.SIGTERM, None)
        assert exits == [130]
    assert signal.getsignal(signal.SIGINT) is before  # put back
    assert control.stop_exit_status(signal.SIGTERM) == 143


# -- the launcher's handler ---------------------------------------------------------------------------
def test_launcher_announces_and_forwards_the_first_signal_and_kills_on_the_second(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    events = []
    monkeypatch.setattr(elastic.os, "kill", lambda pid, sig: events.append(("kill", pid, sig)))
    stop = elastic.StopForwarding(lambda: [11, 12], lambda sig: events.append(("announce", sig)))
    stop(signal.SIGTERM, None)
    # announced first: a rank registering meanwhile is listed, or finds the announcement
    assert events == [("announce", signal.SIGTERM), ("kill", 11, signal.SIGTERM), ("kill", 12, signal.SIGTERM)]
    assert not stop.hard
    with pytest.raises(SignalException) as raised:
        stop(signal.SIGINT, None)
    assert raised.value.sigval == signal.SIGKILL  # the agent kills the workers: no traceback from them
    assert stop.hard and stop.signum == signal.SIGTERM and len(events) == 3


def test_a_rank_registering_after_the_signal_takes_the_announced_stop(tmp_path, monkeypatch):
    from dynmoe_dist.train import cli

    monkeypatch.setenv(cli.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    early, late = control.StopSignals(), control.StopSignals()
    cli.register_rank(early)
    assert not early.requested and cli.rank_pids(tmp_path) == [os.getpid()]
    cli.announce_stop(tmp_path, signal.SIGINT)
    cli.register_rank(late)
    assert late.signum == signal.SIGINT


# -- the lines ----------------------------------------------------------------------------------------
def test_resume_command_replaces_every_resume_option_by_auto():
    argv = ["--config", "my run.toml", "--resume", "x/step_1", "--set", "output.resume='y'", "--resume=z", "--set"]
    assert resume_command("launcher/torchrun.sh 2", argv + ["a.b=1"]) == (
        "launcher/torchrun.sh 2 --config 'my run.toml' --set a.b=1 --resume auto"
    )


def test_stop_line_names_step_checkpoint_and_command():
    stopped = {"step": 37, "signal": signal.SIGINT, "checkpoint": "runs/x/checkpoints/step_000037"}
    assert stop_line(stopped, "CMD --resume auto") == (
        "dynmoe-train: stopped by SIGINT after step 37; checkpoint: runs/x/checkpoints/step_000037; "
        "resume: CMD --resume auto"
    )
    stopped.update(signal=signal.SIGTERM, checkpoint=None)
    assert "stopped by SIGTERM after step 37; no checkpoint was written" in stop_line(stopped, "CMD")


def test_checkpoint_line_says_when_and_where_or_that_there_are_none():
    assert checkpoint_line(OutputConfig(out_dir="runs/x")) == (
        "checkpoints: every 500 steps and every 30 min and at the end or a stop (Ctrl-C, SIGTERM), into "
        "runs/x/checkpoints (the newest 2 kept); resume with --resume auto"
    )
    off = OutputConfig(checkpoint_every=0, checkpoint_minutes=0, final_checkpoint=False)
    assert checkpoint_line(off).startswith("checkpoints: none (") and "cannot be resumed" in checkpoint_line(off)


def test_unreachable_first_window_names_its_step_the_last_step_and_the_options():
    # 133 steps per epoch, the window 1/3 .. 2/3: recorded from step 44, the event after step 88.
    window = WindowSchedule.build(load_config(None, []).adaptive, 133)
    assert (window.start, window.end) == (44, 88)
    line = unreachable_window_line(window, 30, by_epoch=True)
    assert line == (
        "no expert is added, removed or moved: the first adaptive window ends at step 88, after the run's last "
        "step 30 (one window per epoch of 133 steps); raise train.max_steps (or train.epochs) to at least 88, or "
        "set a shorter window period, e.g. adaptive.period_steps = 30"
    )
    assert unreachable_window_line(window, 88, by_epoch=True) is None
    period = WindowSchedule.build(load_config(None, ["adaptive.period_steps=60"]).adaptive, 133)
    assert "ends at step 40, after the run's last step 30 (one window every 60 steps (adaptive.period_steps))" in (
        unreachable_window_line(period, 30, by_epoch=False)
    )


# -- metrics readers ----------------------------------------------------------------------------------
def _step(n, loss):
    return {"kind": "step", "step": n, "loss": loss}


def test_a_resume_replaces_what_was_recorded_past_its_step():
    records = [
        _step(20, 1.0),
        {"kind": "eval", "step": 20},
        _step(21, 2.1),
        {"kind": "event", "step": 22, "layer": 0},
        _step(23, 2.3),  # crashed after step 23; the checkpoint was step 20
        {"kind": "resume", "step": 20, "checkpoint": "c/step_000020"},
        _step(21, 3.1),
        _step(22, 3.2),
    ]
    got = latest_attempt(records)
    assert [(r["kind"], r["step"]) for r in got] == [
        ("step", 20),
        ("eval", 20),
        ("resume", 20),
        ("step", 21),
        ("step", 22),
    ]
    assert [r["loss"] for r in got if r["kind"] == "step"] == [1.0, 3.1, 3.2]


def test_a_resume_after_the_end_drops_the_earlier_final_and_old_files_rewind_by_step():
    ended = [_step(30, 1.0), {"kind": "final", "step": 30}, {"kind": "resume", "step": 30}, _step(31, 0.9)]
    assert [r["kind"] for r in latest_attempt(ended)] == ["step", "resume", "step"]
    # written before resume records: steps 21-23 twice, log_every 1
    old = [_step(20, 1.0), _step(21, 2.1), _step(22, 2.2), _step(23, 2.3), _step(21, 3.1), _step(22, 3.2)]
    assert [(r["step"], r["loss"]) for r in latest_attempt(old)] == [(20, 1.0), (21, 3.1), (22, 3.2)]


def test_every_reader_reads_the_latest_attempt(tmp_path):
    from dynmoe_dist.cluster.submit import read_records

    records = [_step(1, 1.0), _step(2, 2.0), {"kind": "resume", "step": 1}, _step(2, 2.5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for got in (read_metrics(tmp_path / "metrics.jsonl"), read_records(tmp_path)):
        assert [r["loss"] for r in got if r["kind"] == "step"] == [1.0, 2.5]


# -- retention ----------------------------------------------------------------------------------------
class NoGroups:
    rank, distributed = 0, False


def _manager(tmp_path, keep):
    config = load_config(None, [f"output.out_dir='{tmp_path}'", f"output.keep_checkpoints={keep}"])
    return ckpt.CheckpointManager(config, NoGroups(), {})


def _complete(root, step):
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "meta.pt").write_bytes(b"")
    return path


def test_retention_keeps_the_newest_and_never_touches_the_one_being_written(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _complete(root, step)
    (root / "step_000040.tmp").mkdir()  # being written
    (root / "step_000005.old").mkdir()  # a deletion cut short earlier
    _manager(tmp_path, keep=2)._prune(2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000020", "step_000030", "step_000040.tmp"]


def test_a_deletion_cut_short_leaves_no_checkpoint_a_reader_would_take(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    old, new = _complete(root, 10), _complete(root, 20)
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda path, ignore_errors=False: None)  # killed while deleting
    ckpt.retire(old)
    assert ckpt.complete_checkpoints(str(tmp_path)) == [new] and (root / "step_000010.old" / "meta.pt").exists()


def test_commit_over_a_checkpoint_of_the_same_step_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    final = _complete(root, 20)
    tmp = root / "step_000020.tmp"
    tmp.mkdir()
    (tmp / "meta.pt").write_bytes(b"new")
    ckpt.commit(tmp, final)
    assert (final / "meta.pt").read_bytes() == b"new" and sorted(p.name for p in root.iterdir()) == ["step_000020"]


def test_checkpoint_minutes_below_zero_is_refused():
    with pytest.raises(ValueError, match=r"output.checkpoint_minutes \(-1.0\) must be >= 0"):
        OutputConfig(checkpoint_minutes=-1.0)


def test_a_single_process_says_the_line_itself_and_a_rank_under_the_launcher_leaves_it(tmp_path, monkeypatch, capsys):
    from dynmoe_dist.train import cli

    stopped = {"kind": "stopped", "step": 5, "signal": signal.SIGTERM, "checkpoint": "c/step_000005", "rank0": True}
    monkeypatch.delenv(cli.ERROR_DIR_ENV, raising=False)
    assert cli.report_stop(stopped, ["--out-dir", "o"]) == 143
    assert capsys.readouterr().err == (
        "dynmoe-train: stopped by SIGTERM after step 5; checkpoint: c/step_000005; "
        "resume: python -m dynmoe_dist.train --out-dir o --resume auto\n"
    )
    monkeypatch.setenv(cli.ERROR_DIR_ENV, str(tmp_path))
    assert cli.report_stop(stopped, []) == 0  # the launcher exits 143; a rank that did would be restarted
    assert cli.read_stop(tmp_path) == {"step": 5, "signal": signal.SIGTERM, "checkpoint": "c/step_000005"}
    assert capsys.readouterr().err == ""


def test_the_launchers_line_says_how_the_job_stopped(tmp_path, capsys):
    from dynmoe_dist.train.launch import stopped_outcome

    def said(stop, failures):
        status = stopped_outcome(stop, failures, tmp_path / "errors", str(tmp_path), "CMD")
        return status, capsys.readouterr().err

    (tmp_path / "errors").mkdir()
    stop = elastic.StopForwarding(lambda: [], lambda sig: None)
    stop.signum = signal.SIGINT
    assert said(stop, {}) == (None, "")  # the run ended before a rank saw the signal: its own summary
    assert said(stop, {1: 17}) == (None, "")  # a rank crashed on its own: the launcher's crash line
    assert said(stop, {1: -2, 0: -15}) == (
        130,
        "dynmoe-train: stopped while the ranks started, without a checkpoint; no checkpoint to resume from\n",
    )
    _complete(tmp_path / "checkpoints", 30)
    stop.hard = True
    assert said(stop, {}) == (
        130,
        "dynmoe-train: stopped at once by a second SIGINT, without a checkpoint; newest checkpoint: "
        f"{tmp_path}/checkpoints/step_000030; resume: CMD\n",
    )
    stop.hard = False
    (tmp_path / "errors" / "stopped.json").write_text(json.dumps({"step": 31, "signal": 2, "checkpoint": "c/31"}))
    assert said(stop, {}) == (130, "dynmoe-train: stopped by SIGINT after step 31; checkpoint: c/31; resume: CMD\n")


# -- a run, in this process ---------------------------------------------------------------------------
def _tiny_config(out_dir, *extra):
    from cli_runs import tiny_cli_args

    args = tiny_cli_args(120, 6, f"output.out_dir='{out_dir}'", "adaptive.enabled=false", *extra)
    return load_config(None, args[1::2])


def test_a_checkpoint_due_by_time_is_written_by_every_step_and_retention_keeps_two(tmp_path):
    from dynmoe_dist.train.run import run

    final = run(_tiny_config(tmp_path, "output.checkpoint_minutes=1e-9", "output.checkpoint_every=0"))
    assert final["kind"] == "final" and final["checkpoint"] == str(tmp_path / "checkpoints" / "step_000006")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000005", "step_000006"]


def test_a_stop_asked_before_the_first_step_ends_the_run_after_it_with_a_checkpoint(tmp_path):
    from dynmoe_dist.train.run import run

    signals = control.StopSignals()
    signals.signum = signal.SIGINT  # as the handler sets it
    stopped = run(_tiny_config(tmp_path), signals=signals)
    assert stopped == {
        "kind": "stopped",
        "step": 1,
        "signal": signal.SIGINT,
        "checkpoint": str(tmp_path / "checkpoints" / "step_000001"),
        "rank0": True,
    }
    kinds = [r["kind"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert kinds == ["step"]  # the stop's step is logged; no eval, no final
