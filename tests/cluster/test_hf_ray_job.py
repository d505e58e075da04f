"""`ray job submit` of the tiny upcycled HF LLaMA (a run file under tmp_path + --set ep_size 2; float64,
adaptive events that remove and add experts, planned by the Ray actor) on a local Ray head logs the
per-step losses, events and expert counts of a 1-process `python -m dynmoe_dist.train` run (1e-9); so does an
imported MoE (a tiny OLMoE checkpoint) converted to top-any, and a LoRA finetune of a tiny Qwen3-MoE (native
routing), whose checkpoint holds the adapters only and exports both ways: PEFT's load of the unmerged adapter onto
the base has the merged export's logits."""

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

from dynmoe_dist.export import main as export_main
from dynmoe_dist.moe.adapters import is_adapter
from dynmoe_dist.train.checkpoint_parts import expert_file, expert_file_owners
from dynmoe_dist.train.dense_state import read_metadata
from dynmoe_dist.train.tensor_file import read_tensors

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


def test_ray_job_of_a_lora_finetune_matches_one_process_and_exports(ray_head, tmp_path):
    """LoRA on the attention and every routed expert of an imported Qwen3-MoE as a 2-worker Ray job, each worker
    holding half the experts with their adapters, adaptive events (its own routing: they only re-place experts)
    planned by the Ray actor: the one-process run's losses; the
    final checkpoint has no frozen base tensor (the dense state adapters and routers, each worker's expert file
    adapters only); exported merged and as a PEFT adapter, the two give the same logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    files = tmp_path / "files"
    model_dir, vocab = save_moe_checkpoint("qwen3_moe", files / "qwen3_moe")
    text_file = files / "corpus.txt"
    text_file.write_text("\n".join(corpus_lines()) + "\n")
    lora = ("lora.enabled=true", "lora.rank=2", "lora.alpha=4.0", "lora.targets=['attention', 'routed_experts']")
    settings = moe_run_settings(model_dir, text_file, 1, *lora, steps=STEPS, batch=7)
    _, job = job_against_one_process(ray_head, tmp_path, "lora", settings)
    assert any(event["moves"] for event in job.records("event"))  # adapters moved between the workers

    (checkpoint,) = (job.out_dir / "checkpoints").glob("step_*")
    dense_keys = read_metadata(checkpoint / "dense").state_dict_metadata
    names = {key.split("/")[1] for key in dense_keys}
    assert any("q_proj.lora_a" in n for n in names) and all(is_adapter(n) or ".router." in n for n in names)
    owners = expert_file_owners(checkpoint)
    assert len(owners) == 2
    for owner in owners:
        flat = read_tensors(expert_file(checkpoint, owner))
        assert flat and all(name.split("/")[3].startswith("lora_") for name in flat), sorted(flat)

    export_main([str(checkpoint), "--out", str(tmp_path / "merged")])
    export_main([str(checkpoint), "--out", str(tmp_path / "adapter"), "--adapter"])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(3))

    def load(directory):
        model = AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager", dtype=torch.float64)
        return model.eval()

    with torch.no_grad():
        merged, base = load(tmp_path / "merged")(ids).logits, load(model_dir)
        assert (merged - base(ids).logits).abs().max() > 1e-4  # the adapters trained
        unmerged = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))(input_ids=ids).logits  # base adapted
    torch.testing.assert_close(unmerged, merged, rtol=0, atol=1e-10)
