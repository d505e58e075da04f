"""What a user sees while waiting: a bar that advances through every wait of more than a few seconds
(calibration, held-out scoring, final evaluation), the finished training bar once, the final result once.

The bars write to stderr, which pytest captures (not a terminal): the log-file redraw interval and the
wait bars' delay are set to 0 so that every advance is drawn."""

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from cli_runs import tiny_cli_args  # noqa: E402
from hf_tiny import corpus_lines, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.train import progress  # noqa: E402

TINY = tiny_cli_args(120, 6, "adaptive.period_steps=3")


@pytest.fixture
def every_redraw(monkeypatch):
    monkeypatch.setattr(progress, "LOG_FILE_REDRAW_S", 0.0)
    monkeypatch.setattr(progress, "WAIT_SHOWN_AFTER_S", 0.0)


def counts_shown(err: str, description: str, total: int):
    """The n of every 'n/total' drawn on a line of the bar named ``description``, each once (a closing
    bar draws its last count again), without the empty bar's 0."""
    lines = [line for line in re.split(r"[\r\n]", err) if line.startswith(description + ":")]
    drawn = [int(n) for line in lines for n in re.findall(rf"(\d+)/{total}\b", line)]
    return [n for i, n in enumerate(drawn) if n and (i == 0 or n != drawn[i - 1])]


def progress_on(args):
    return [a.replace("output.progress=false", "output.progress=true") for a in args]


def test_wait_bar_advances_and_is_silent_when_disabled(capsys, every_redraw):
    with progress.WaitBar("scoring", 3, "batch") as bar:
        for _ in range(3):
            bar.advance()
    assert counts_shown(capsys.readouterr().err, "scoring", 3) == [1, 2, 3]
    with progress.WaitBar("scoring", 3, "batch", enabled=False) as bar:
        bar.advance()
    assert capsys.readouterr() == ("", "")


def test_evaluation_shows_a_bar_over_the_held_out_batches_on_rank0_only(capsys, every_redraw, monkeypatch):
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(load_config(None, [a for a in progress_on(TINY) if a != "--set"]))
    num_batches = len(trainer.eval_ranges)
    assert num_batches >= 2  # 24 test samples, 8 a batch
    trainer.evaluate("final evaluation")
    shown = counts_shown(capsys.readouterr().err, "final evaluation", num_batches)
    assert shown == list(range(1, num_batches + 1))
    # any other rank of the job scores silently (here: this process told it is not rank 0)
    monkeypatch.setattr(Trainer, "is_rank0", property(lambda self: False))
    trainer.evaluate("final evaluation")
    assert capsys.readouterr() == ("", "")


def test_calibration_shows_a_bar_over_the_layers_then_over_the_scoring(tmp_path, capsys, every_redraw):
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import calibrate_at_start

    directory, _ = save_moe_checkpoint("olmoe", tmp_path / "olmoe")
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines(60, 2)) + "\n")
    settings = [f"task.path='{tmp_path / 'c.txt'}'", f"model.path='{directory}'", "moe.calibrate_samples=20"]
    settings += ["task.name='causal-lm'", "task.max_len=8", "model.source='hf'", "moe.router='top_any'"]
    trainer = Trainer(load_config(None, settings))
    assert calibrate_at_start(trainer)["kind"] == "calibration"
    err = capsys.readouterr().err
    num_layers = len(trainer.moe_layers)
    assert counts_shown(err, "calibrating top-any thresholds", num_layers) == list(range(1, num_layers + 1))
    num_batches = len(trainer.eval_ranges)
    assert counts_shown(err, "held-out scoring after the conversion", num_batches)[-1] == num_batches
    assert err.index("calibrating") < err.index("held-out scoring")


def test_a_run_prints_its_finished_bar_once_and_its_final_result_once(tmp_path, capsys):
    from dynmoe_dist.train.cli import main

    assert main(progress_on(TINY) + ["--out-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert len(re.findall(r"\b6/6\b", err)) == 1, err  # the training bar's last draw, with one rate
    assert out.count("final (step 6") == 1 and "final step" not in out, out
    assert "test accuracy" in out
