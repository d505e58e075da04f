"""`python -m dynmoe_dist.bench gpu`: what can be checked without a GPU.

On CPU every CUDA section skips with the reason "no CUDA" and both files are still written; the
section runner records pass / fail / skip and isolates failures and time-outs; the rehearsal runs the
sections' real code on CPU at toy sizes; and from a plain checkout (no install) the command imports
nothing beyond what the GPU machine has.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynmoe_dist.bench import gpu, gpu_sections

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_run_skips_cuda_sections_and_writes_json_and_markdown(tmp_path):
    report = gpu.main(["--out", str(tmp_path)])
    gpu.check_schema(report)
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    gpu.check_schema(on_disk)
    by_name = {r["name"]: r for r in on_disk["sections"]}
    assert list(by_name) == [s.name for s in gpu_sections.SECTIONS]
    for section in gpu_sections.SECTIONS:
        record = by_name[section.name]
        if section.needs_cuda:
            assert (record["status"], record["reason"]) == ("skip", "no CUDA")
        else:
            assert record["status"] == "pass", record
    text = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {s.name} |" in text for s in gpu_sections.SECTIONS)


def _busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_runner_isolates_failures_timeouts_and_skips():
    def boom(ctx):
        raise ValueError("boom")

    def skip(ctx):
        raise gpu.Skip("not here")

    sections = [
        gpu.Section("raises", boom, 5, needs_cuda=False),
        gpu.Section("hangs", lambda ctx: _busy(10) or {}, 1, needs_cuda=False),
        gpu.Section("skips", skip, 5, needs_cuda=False),
        gpu.Section("wrong", lambda ctx: {"passed": False, "summary": "off"}, 5, needs_cuda=False),
        gpu.Section("cuda only", lambda ctx: {}, 5, needs_cuda=True),
        gpu.Section("fine", lambda ctx: {"summary": "ok"}, 5, needs_cuda=False),
    ]
    started = time.monotonic()
    records = gpu.run_sections(sections, {"cuda": False}, budget_s=60)
    assert time.monotonic() - started < 5  # the hanging section lost only its own cap
    assert [r["status"] for r in records] == ["fail", "fail", "skip", "fail", "skip", "pass"]
    assert "ValueError: boom" in records[0]["error"]
    assert "time cap of 1 s" in records[1]["error"]
    assert records[2]["reason"] == "not here" and records[4]["reason"] == "no CUDA"
    report = gpu.build_report(records, {"started_utc": "now"}, 1.0)
    gpu.check_schema(report)
    assert report["summary"] == {"pass": 1, "fail": 3, "skip": 2}
    assert "| wrong | fail |" in gpu.markdown(report) and "boom" in gpu.markdown(report)


def test_spent_budget_skips_the_rest():
    records = gpu.run_sections([gpu.Section("late", lambda ctx: {}, 5, needs_cuda=False)], {}, budget_s=0)
    assert records[0]["status"] == "skip" and "budget" in records[0]["reason"]


def test_schema_check_names_the_bad_key():
    with pytest.raises(ValueError, match="'wall_s'"):
        gpu.check_schema({"schema": gpu.SCHEMA, "started_utc": "x", "wall_s": "slow"})


def test_unknown_section_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"--only \('nope'\)"):
        gpu.main(["--out", str(tmp_path), "--only", "nope"])


def _rehearse(tmp_path, only):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "dynmoe_dist.bench", "gpu", "--out", str(tmp_path), "--rehearse-on-cpu", "--only", only],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    gpu.check_schema(report)
    return {r["name"]: r for r in report["sections"]}


def test_rehearsal_runs_the_layer_and_kernel_sections_on_cpu(tmp_path):
    records = _rehearse(tmp_path, "triton_kernels,layer_correctness,grouped_mm_vs_loop,host_syncs,throughput")
    for name, record in records.items():
        assert "error" not in record, (name, record.get("error"))
    assert records["layer_correctness"]["status"] == "pass", records["layer_correctness"]["result"]["failed"]
    cases = records["layer_correctness"]["result"]["cases"]
    assert any(c["k0_tokens"] for c in cases) and any(c["empty_experts"] for c in cases)
    assert records["host_syncs"]["status"] == "pass"
    if records["triton_kernels"]["status"] != "skip":
        assert records["triton_kernels"]["status"] == "pass"
    assert set(records["throughput"]["result"]["results"][0]["cases"]) == {"top_k", "top_any", "dense_ffn"}


def test_rehearsal_trains_checkpoints_and_resumes_on_cpu(tmp_path):
    record = _rehearse(tmp_path, "trainer")["trainer"]
    assert record["status"] == "pass", record
    (run,) = record["result"]["runs"]
    assert run["adaptive_events"] >= 1 and run["checkpoints"] and run["resumed_final_step"] == 8


def test_rehearsal_imports_a_moe_and_trains_it_with_and_without_lora_on_cpu(tmp_path):
    record = _rehearse(tmp_path, "imported_moe")["imported_moe"]
    assert record["status"] == "pass", record
    result = record["result"]
    assert result["first_loss_relative_difference"] <= 1e-4
    assert result["lora"]["adapters_moved"] == result["lora"]["trainable"] > 0 and not result["lora"]["frozen_moved"]


def test_the_imported_moe_section_fails_on_a_loss_mismatch_or_a_moved_base():
    from dynmoe_dist.bench.gpu_hf_moe import summarize

    side = {"first_loss": 2.0, "step_s": 1.0}
    lora = {"trainable": 2, "frozen": 3, "frozen_moved": [], "adapters_moved": 2, "losses": [2.0, 1.9]}
    assert summarize({"theirs": side, "ours": side, "lora": lora})["ours_over_transformers"] == 1.0
    with pytest.raises(AssertionError, match="first loss"):
        summarize({"theirs": side, "ours": {**side, "first_loss": 2.01}, "lora": lora})
    with pytest.raises(AssertionError, match="LoRA moved frozen"):
        summarize({"theirs": side, "ours": side, "lora": {**lora, "frozen_moved": ["model.embed_tokens.weight"]}})


PLAIN_CHECKOUT = r"""
import json, sys
# Drop the editable install's finder: import dynmoe_dist from the checkout as PYTHONPATH=. would.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
import torch
baseline = set(sys.modules)
from dynmoe_dist.bench import gpu, gpu_sections
gpu.main(["--out", sys.argv[1]])
import dynmoe_dist.kernels
stdlib = set(sys.stdlib_module_names) | {"cython_runtime"}
new = {m.split(".")[0] for m in set(sys.modules) - baseline if not m.startswith("_")} - stdlib
allowed = gpu_sections.ALLOWED_IMPORTS | gpu_sections.torch_requirements()
print(json.dumps({"new": sorted(new), "allowed": sorted(allowed),
                  "dynmoe_dist": __import__("dynmoe_dist").__file__, "kernels": list(dynmoe_dist.kernels.__path__)}))
"""


def test_plain_checkout_runs_and_imports_only_what_the_gpu_machine_has(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_CHECKOUT, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["kernels"] == [str(ROOT / "kernels")]
    assert seen["dynmoe_dist"] == str(ROOT / "dynmoe_dist" / "__init__.py")
    assert set(seen["new"]) <= set(seen["allowed"]), sorted(set(seen["new"]) - set(seen["allowed"]))
    assert (tmp_path / "gpu_check.json").is_file() and (tmp_path / "gpu_check.md").is_file()


def test_a_section_whose_function_is_missing_fails_the_import(monkeypatch):
    """Sections name their functions directly: deleting one makes importing the sections an error
    (the hf_smollm2 section used to probe for a function that existed nowhere, and always skipped)."""
    import importlib
    import inspect

    from dynmoe_dist.bench import gpu_runner
    from dynmoe_dist.bench import hf as hf_bench

    assert all(
        inspect.isfunction(s.run) and s.run.__module__.startswith("dynmoe_dist.bench") for s in gpu_sections.SECTIONS
    )
    with pytest.raises(TypeError, match=r"section 'x': run \(None\) is not a function"):
        gpu_runner.Section("x", None, 5)
    monkeypatch.delattr(hf_bench, "gpu_step_tokens_per_s")
    with pytest.raises(AttributeError, match="gpu_step_tokens_per_s"):
        importlib.reload(gpu_sections)
    monkeypatch.undo()
    importlib.reload(gpu_sections)


def test_the_hf_section_times_a_training_step_on_cpu_in_rehearsal():
    from dynmoe_dist.bench import hf as hf_bench

    result = hf_bench.gpu_step_tokens_per_s({"device": "cpu", "rehearsal": True})
    assert result["tokens_per_s"] > 0 and len(result["step_s"]) == hf_bench.REHEARSAL_CASE["steps"]
