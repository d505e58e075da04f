"""`ray job submit` of the tiny upcycled HF LLaMA (a run file under tmp_path + --set ep_size 2; float64,
adaptive events that remove and add experts, planned by the Ray actor) on a local Ray head logs the
per-step losses, events and expert counts of a 1-process `python -m dynmoe_dist.train` run (1e-9); so does an
imported MoE (a tiny OLMoE checkpoint) converted to top-any."""

import sys
from collections import defaultdict
from pathlib import Path

import pytest
from hf_tiny import (
    STEPS,
    changes,
    corpus_lines,
    hf_settings,
    moe_run_settings,
    save_moe_checkpoint,
    train,
    write_tiny_run,
)
from raytest import read_records, submit_job

# About 70 s (Ray head start, job upload, 2 workers loading transformers) on 2 shared cores.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]


def write_run_file(path: Path, settings) -> Path:
    """--set overrides (SECTION.KEY=TOML value) as a TOML run file."""
    sections = defaultdict(list)
    for setting in settings:
        key, value = setting.split("=", 1)
        section, name = key.split(".", 1)
        sections[section].append(f"{name} = {value}")
    path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n\n" for s, lines in sections.items()))
    return path


def job_against_one_process(ray_head, tmp_path, name, settings):
    """The run as one process and as a 2-worker Ray job (ep 2, the actor planning): the job's per-step
    losses (1e-9) and expert counts are the process's; (reference records, job)."""
    reference = train([sys.executable, "-m", "dynmoe_dist.train"], tmp_path / "one", settings)
    run_file = write_run_file(tmp_path / f"{name}.toml", settings)
    job = submit_job(ray_head, tmp_path, name, ["parallel.ep_size=2"], config=str(run_file))
    assert job.succeeded, job.output[-4000:]
    assert job.summary()["steps"] == STEPS and job.summary()["planned_by"] == ["ray"]
    got = {r["step"]: r for r in job.records("step")}
    want = {r["step"]: r for r in reference if r["kind"] == "step"}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, record in want.items():
        assert abs(got[step]["loss"] - record["loss"]) <= 1e-9 * abs(record["loss"]), step
        assert got[step]["num_experts"] == record["num_experts"], step
    return reference, job


def test_ray_job_of_an_hf_model_matches_one_process(ray_head, tmp_path):
    settings = hf_settings(*write_tiny_run(tmp_path / "files"))
    reference, job = job_against_one_process(ray_head, tmp_path, "hf", settings)
    events = changes(reference)
    assert any(e[2] for e in events) and any(e[3] for e in events)
    assert changes(read_records(job.out_dir, "event")) == events


def test_ray_job_of_an_imported_moe_matches_one_process(ray_head, tmp_path):
    """An imported OLMoE converted to top-any (thresholds calibrated at the start over every rank's tokens,
    then events that remove experts) as a 2-worker Ray job: the one-process run's losses, expert counts,
    events and post-conversion loss."""
    files = tmp_path / "files"
    model_dir, _ = save_moe_checkpoint("olmoe", files / "olmoe")
    text_file = files / "corpus.txt"
    text_file.write_text("\n".join(corpus_lines()) + "\n")
    converted = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16")
    settings = moe_run_settings(model_dir, text_file, 1, *converted, steps=STEPS, batch=7)
    reference, job = job_against_one_process(ray_head, tmp_path, "moe", settings)
    events = changes(reference)
    assert any(e[2] for e in events)  # the conversion's domain pruning removed experts
    assert changes(read_records(job.out_dir, "event")) == events
    (want_calibration,) = [r for r in reference if r["kind"] == "calibration"]
    (got_calibration,) = job.records("calibration")  # once, by rank 0, before the first step
    loss0 = want_calibration["test_loss_after_conversion"]
    assert abs(got_calibration["test_loss_after_conversion"] - loss0) <= 1e-9 * abs(loss0)
