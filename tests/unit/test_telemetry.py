"""Telemetry (metrics.jsonl, TensorBoard, progress bar) and the run report's data shaping and drawing."""

import json
import math
import sys

import numpy as np
import pytest

from dynmoe_dist.train import report
from dynmoe_dist.train.progress import ProgressBar
from dynmoe_dist.train.report import bin_columns, column_edges, draw_report, latest_attempt, report_series, smooth
from dynmoe_dist.train.telemetry import (
    METRICS_FILE,
    MetricsWriter,
    Telemetry,
    TensorBoardWriter,
    describe_event,
    progress_postfix,
    read_metrics,
)

NAN = math.nan


def step_record(step, num_experts, expert_load, rank_load=None, **scalars):
    return {
        "kind": "step",
        "step": step,
        "num_experts": num_experts,
        "expert_load": expert_load,
        "mean_k": [sum(load) / 4 for load in expert_load],
        "num_replicas": [0] * len(num_experts),
        "rank_load": rank_load or [[sum(load)] for load in expert_load],
        **scalars,
    }


def fake_run(num_steps, num_layers, evals=True, events=True, health=False):
    """A small run: every layer loses its last expert at step num_steps // 2 (an event); with ``health``
    the step records carry the MoE health metrics and the event its window's summary."""
    records = []
    for step in range(1, num_steps + 1):
        num_experts = [4 if step <= num_steps // 2 or not events else 3] * num_layers
        loads = [[step % 3 + e for e in range(n)] for n in num_experts]
        extra = {}
        if health:
            extra = {
                "load_cv": [0.5 / step] * num_layers,
                "k_histogram": [[1, 2, 3, 0, 0, 0, 0, 0, 0]] * num_layers,
                "expert_utilization": [[c / 10 for c in load] for load in loads],
            }
        records.append(step_record(step, num_experts, loads, loss=1.0 / step, accuracy=step / num_steps, **extra))
        if events and step == num_steps // 2:
            if health:
                dead = [[3]] * num_layers
                records.append(
                    {"kind": "window", "step": step, "dead_experts": dead, "blocks": list(range(num_layers))}
                )
            records += [
                {"kind": "event", "step": step, "layer": layer, "removed": [3], "added": [], "replicas": {}}
                for layer in range(num_layers)
            ]
        if evals and step % 10 == 0:
            records.append({"kind": "eval", "step": step, "test_loss": 0.5, "test_accuracy": 0.6})
    return records


# ----------------------------------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_round_trip_survives_a_torn_last_line(tmp_path):
    first = step_record(1, [2], [[3, 1]], loss=np.float32(0.5))  # numpy values must serialise
    with MetricsWriter(tmp_path) as writer:
        writer.write(first)
        writer.write({"kind": "eval", "step": 1, "test_loss": NAN})  # a diverged eval is still recorded
    path = tmp_path / METRICS_FILE
    with open(path, "a") as file:
        file.write('{"kind": "step", "step": 2, "lo')  # crash mid-write
    records = read_metrics(path)
    assert [r["kind"] for r in records] == ["step", "eval"]
    assert records[0]["loss"] == 0.5 and records[0]["expert_load"] == [[3, 1]]
    assert math.isnan(records[1]["test_loss"])
    # A resumed run appends: the torn fragment is cut so the new record is on a line of its own.
    with MetricsWriter(tmp_path) as writer:
        writer.write({"kind": "final", "step": 2, "test_accuracy": 0.7})
    assert [r["kind"] for r in read_metrics(path)] == ["step", "eval", "final"]


def test_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"kind": "step", "step": 1}\n{"kind": "st\n{"kind": "step", "step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"kind": "stpe", "step": 1}, "record kind"),
        ({"kind": "step", "step": -1}, r"record step \(-1\)"),
        (
            {**step_record(1, [2, 3], [[1, 1], [1, 1, 1]]), "expert_load": [[1, 1]]},
            r"len\(expert_load\) \(1\) != number of MoE layers \(2",
        ),
        (step_record(1, [2], [[1, 1, 1]]), r"len\(expert_load\[0\]\) \(3\) != num_experts\[0\] \(2\)"),
    ],
)
def test_malformed_records_are_rejected(tmp_path, record, message):
    with MetricsWriter(tmp_path) as writer, pytest.raises(ValueError, match=message):
        writer.write(record)


# ----------------------------------------------------------------------------------------------------
# report_series (exact)

HAND_MADE = [
    step_record(1, [3, 2], [[4, 0, 2], [3, 3]], rank_load=[[4, 2], [3, 3]], loss=2.0, accuracy=0.25),
    step_record(2, [3, 2], [[5, 1, 0], [2, 4]], rank_load=[[6, 0], [3, 3]], loss=1.5, accuracy=0.5),
    {"kind": "event", "step": 2, "layer": 0, "removed": [1], "added": [], "replicas": {}},
    {"kind": "event", "step": 2, "layer": 1, "removed": [], "added": [{"expert": 2}], "replicas": {"0": 2}},
    {"kind": "eval", "step": 2, "test_loss": 1.5, "test_accuracy": 0.5},
    step_record(3, [2, 3], [[6, 2], [1, 1, 4]], rank_load=[[6, 2], [3, 3]], loss=1.0),  # no accuracy
    # Same replica map as layer 1's previous event: not a new replication; the removal is marked.
    {"kind": "event", "step": 3, "layer": 1, "removed": [2], "added": [], "replicas": {"0": 2}},
    {"kind": "final", "step": 3, "test_loss": 1.25, "test_accuracy": 0.75, "wall_s": 9.0},
]


def test_report_series_on_hand_made_records():
    series = report_series(HAND_MADE)
    assert series.steps_S.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(series.loss_S, [2.0, 1.5, 1.0])
    np.testing.assert_array_equal(series.accuracy_S, [0.25, 0.5, NAN])
    layer0, layer1 = series.layers
    assert layer0.num_experts_S.tolist() == [3, 3, 2] and layer1.num_experts_S.tolist() == [2, 2, 3]
    # Rows are expert slots, columns steps; a slot the layer did not have at that step is NaN.
    np.testing.assert_array_equal(layer0.load_XS, [[4, 5, 6], [0, 1, 2], [2, 0, NAN]])
    np.testing.assert_array_equal(layer1.load_XS, [[3, 2, 1], [3, 4, 1], [NAN, NAN, 4]])
    np.testing.assert_allclose(layer0.mean_k_S, [6 / 4, 6 / 4, 8 / 4])
    # max / mean over ranks: [4, 2] -> 4/3, [6, 0] -> 2, [6, 2] -> 1.5
    np.testing.assert_allclose(layer0.rank_imbalance_S, [4 / 3, 2.0, 1.5])
    np.testing.assert_allclose(layer1.rank_imbalance_S, [1.0, 1.0, 1.0])
    # The final record adds the last test point (no eval at step 3).
    assert series.eval_steps.tolist() == [2, 3]
    np.testing.assert_array_equal(series.test_accuracy, [0.5, 0.75])
    assert series.events == [(2, 0, "removed"), (2, 1, "added"), (2, 1, "replicated"), (3, 1, "removed")]
    assert series.event_steps("removed").tolist() == [2, 3]
    assert series.event_steps("removed", layer=0).tolist() == [2]
    assert series.event_steps("replicated").tolist() == [2]


def test_moves_are_drawn_as_event_lines_with_their_legend_entry():
    """A re-placement (experts moved between ranks, nothing added, removed or replicated) is an adaptive
    event like the others: a vertical line at its step and an entry in the events legend."""
    from matplotlib.figure import Figure

    moved = {"kind": "event", "step": 2, "layer": 1, "removed": [], "added": [], "replicas": {}, "moves": 3}
    series = report_series(HAND_MADE[:2] + [moved])
    assert series.events == [(2, 1, "moved")] and series.event_steps("moved", layer=1).tolist() == [2]
    figure = Figure()
    axes = figure.add_subplot()
    report._mark_events(axes, series)
    report._event_legend(figure, series)
    (lines,) = axes.collections
    assert [segment[0][0] for segment in lines.get_segments()] == [2]
    assert [text.get_text() for text in figure.legends[0].get_texts()] == ["experts moved"]


def test_resumed_run_keeps_the_last_attempt_at_each_step():
    first = [step_record(s, [1], [[1]]) for s in (1, 2, 3)] + [{"kind": "eval", "step": 3}]
    resumed = [step_record(s, [1], [[9]]) for s in (2, 3)]  # restarted from the step-1 checkpoint
    kept = latest_attempt(first + resumed)
    assert [(r["step"], r["expert_load"][0][0]) for r in kept if r["kind"] == "step"] == [(1, 1), (2, 9), (3, 9)]
    assert all(r["kind"] == "step" for r in kept)  # the eval of the abandoned attempt is gone


def test_no_step_records_and_inconsistent_layers_are_errors():
    with pytest.raises(ValueError, match="no step records"):
        report_series([{"kind": "final", "step": 0}])
    with pytest.raises(ValueError, match="number of MoE layers"):
        report_series([step_record(1, [2], [[1, 1]]), step_record(2, [2, 2], [[1, 1], [1, 1]])])


def test_smoothing_edges_and_binning():
    # window 2 over [1, nan, 3, 5]: [1] -> 1, [1, nan] -> 1, [nan, 3] -> 3, [3, 5] -> 4
    np.testing.assert_array_equal(smooth(np.array([1.0, NAN, 3.0, 5.0]), 2), [1.0, 1.0, 3.0, 4.0])
    np.testing.assert_array_equal(column_edges(np.array([1, 2, 4])), [0.5, 1.5, 3.0, 5.0])
    np.testing.assert_array_equal(column_edges(np.array([7])), [6.5, 7.5])
    edges = column_edges(np.array([10, 20, 30, 40, 50]))  # [5, 15, 25, 35, 45, 55]
    binned, bin_edges = bin_columns(np.array([[1.0, 2.0, 3.0, 4.0, NAN]]), edges, max_bins=2)
    # groups: columns 0-2 -> mean 2, columns 3-4 -> nanmean 4
    np.testing.assert_array_equal(binned, [[2.0, 4.0]])
    np.testing.assert_array_equal(bin_edges, [5.0, 35.0, 55.0])
    with pytest.raises(ValueError, match=r"max_bins \(0\)"):
        bin_columns(binned, bin_edges, 0)


# ----------------------------------------------------------------------------------------------------
# Drawing


@pytest.mark.parametrize(
    "records",
    [
        pytest.param(fake_run(40, 2), id="two-layers-binned"),
        pytest.param(fake_run(40, 2, health=True), id="moe-health"),
        pytest.param(fake_run(1, 1, evals=False, events=False), id="single-step"),
        pytest.param(fake_run(12, 0, evals=False, events=False), id="no-moe-no-eval-no-events"),
    ],
)
def test_draw_report_writes_a_png(tmp_path, records):
    with MetricsWriter(tmp_path) as writer:
        for record in records:
            writer.write(record)
    out = draw_report(tmp_path / METRICS_FILE, tmp_path / "report.png", max_bins=16)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_cli_takes_a_run_dir(tmp_path, capsys):
    with MetricsWriter(tmp_path) as writer:
        for record in HAND_MADE:
            writer.write(record)
    out = report.main([str(tmp_path)])
    assert out == tmp_path / "report.png" and out.is_file()
    assert capsys.readouterr().out.strip() == str(out)


# ----------------------------------------------------------------------------------------------------
# TensorBoard, progress bar, facade


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path)
    for record in HAND_MADE:
        writer.write(record)
    writer.close()
    events = EventAccumulator(str(writer.log_dir))
    events.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("train/loss") == [(1, 2.0), (2, 1.5), (3, 1.0)]
    assert scalars("moe/layer1/num_experts") == [(1, 2.0), (2, 2.0), (3, 3.0)]
    assert scalars("moe/layer0/mean_k") == [(1, 1.5), (2, 1.5), (3, 2.0)]
    assert scalars("moe/layer0/rank_load_max_over_mean") == [(1, pytest.approx(4 / 3)), (2, 2.0), (3, 1.5)]
    assert scalars("eval/test_accuracy") == [(2, 0.5)]
    assert scalars("final/wall_s") == [(3, 9.0)]
    text = events.Tensors("events/layer1/text_summary")
    assert [e.step for e in text] == [2, 3]
    assert text[0].tensor_proto.string_val[0].decode() == describe_event(HAND_MADE[3])


def test_missing_tensorboard_names_the_report_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[report\]'"):
        TensorBoardWriter(tmp_path)
    Telemetry(tmp_path, total_steps=3, rank0=True, progress=False, tensorboard=False).close()  # the way out


def test_disabled_progress_bar_and_other_ranks_print_nothing(tmp_path, capsys):
    bar = ProgressBar(10, enabled=False)
    bar.update(1, "loss 2.000")
    bar.write("hello")
    bar.close()
    with Telemetry(tmp_path / "rank1", total_steps=3, rank0=False) as telemetry:
        for record in HAND_MADE:
            telemetry.log(record)
    assert capsys.readouterr() == ("", "")
    assert not (tmp_path / "rank1").exists()


def test_rank0_telemetry_writes_metrics_and_prints_events(tmp_path, capsys):
    with Telemetry(tmp_path, total_steps=3, rank0=True, progress=True, tensorboard=False) as telemetry:
        for record in HAND_MADE:
            telemetry.log(record)
    assert read_metrics(tmp_path / METRICS_FILE) == [json.loads(json.dumps(r)) for r in HAND_MADE]
    printed = capsys.readouterr()
    assert "step 2 layer 0: removed [1]" in printed.out
    assert "eval step 2: test_loss 1.5000, test_accuracy 0.5000" in printed.out
    assert "3/3" in printed.err  # the bar reached the last step
    assert not (tmp_path / "tensorboard").exists()


def test_progress_postfix():
    record = {"loss": 1.23, "accuracy": 0.5, "tokens_per_s": 1234.0, "mean_k": [2.1, 1.9], "num_experts": [8, 7]}
    assert progress_postfix(record) == "loss 1.230 acc 0.500 tok/s 1.2k k 2.00 experts 8/7"
    assert progress_postfix({"loss": 0.5, "mean_k": [], "num_experts": []}) == "loss 0.500"


def test_health_series_from_hand_made_records():
    from dynmoe_dist.train.report_health import health_series

    records = fake_run(20, 2, evals=False, health=True)  # window at step 10: expert 3 dead in both layers
    health = health_series(records, 2)
    np.testing.assert_allclose(health.load_cv_LS[0], [0.5 / s for s in range(1, 21)])
    np.testing.assert_array_equal(health.window_steps_W, [10])
    np.testing.assert_array_equal(health.dead_LW, [[1], [1]])
    np.testing.assert_allclose(health.k_share_LK[1], [1 / 6, 2 / 6, 3 / 6] + [0] * 6)  # the last 2 steps' sum
    # utilisation: the last 2 steps (19, 20) with 3 experts: loads (19 % 3 + e) and (20 % 3 + e) over 10 tokens
    np.testing.assert_allclose(health.utilization[0], [(1 + 2) / 20, (2 + 3) / 20, (3 + 4) / 20])


def test_step_health_of_hand_made_counts():
    from dynmoe_dist.train.recorder import health

    # counts 2, 4, 6 of 6 tokens: mean 4, population std sqrt(8/3), cv 0.408
    got = health([2.0, 4.0, 6.0], 6)
    assert got["utilization"] == [2 / 6, 4 / 6, 1.0] and got["load_cv"] == pytest.approx(math.sqrt(8 / 3) / 4)
    assert health([0.0, 0.0], 0)["load_cv"] == 0.0  # no token: an even (empty) load
