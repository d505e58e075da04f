"""Ray job entry point:

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m dynmoe_dist.cluster.submit --config FILE --num-workers N [--use-gpu] [--set a.b=c ...]

The driver builds the RunConfig (the same TOML + ``--set`` as ``dynmoe-train``), puts the run directory at
STORAGE/NAME (metrics.jsonl, checkpoints, report), starts the job's restartable plan actor, and runs Ray
Train ``TorchTrainer`` workers (nccl with GPUs, gloo without). A failed worker makes Ray Train restart the
whole group (``--max-failures``); the new workers resume from the newest complete checkpoint. At the end it
writes ``ray_summary.json``: wall time, steps/s, the adaptive events and who planned them, restarts, and
prints the summary torchrun prints (train/cli.summary: scores, report, checkpoint, export command). The
job's log shows rank 0's progress as torchrun's does (a line every 30 s in a log).

``--check`` (launcher/ray_submit.sh runs it before submitting) also checks that the workers will find every
path the run names (cluster/job_paths.py) and says where the run's files will be.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from dynmoe_dist.cluster import RayMissing, import_ray
from dynmoe_dist.cluster.coordinator import NAMESPACE, actor_name, start_plan_actor
from dynmoe_dist.cluster.job_paths import check_job_paths
from dynmoe_dist.cluster.worker import clear_worker_errors, train_worker, worker_errors, worker_starts

from dynmoe_dist.config import RunConfig, check_world, load_config
from dynmoe_dist.train.cli import USAGE_ERROR, one_line, summary
from dynmoe_dist.train.finish import finished_files
from dynmoe_dist.train.startup import prepare_run
from dynmoe_dist.train.telemetry import METRICS_FILE, read_metrics

SUMMARY_FILE = "ray_summary.json"
RUNTIME_ENV = "cluster/runtime_env.yaml"  # relative to the working dir, as launcher/ray_submit.sh submits it


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.cluster.submit",
        description="Train a DynMoE model on Ray Train workers (run it with `ray job submit`).",
    )
    p.add_argument("--config", help="TOML run file (e.g. launcher/configs/demo.toml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one option (repeatable); see dynmoe-train --help for all options",
    )
    p.add_argument("--num-workers", type=int, required=True, help="training workers (ranks)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker, nccl (default: CPU, gloo)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves per worker")
    p.add_argument(
        "--storage-path",
        default="~/dynmoe_runs",
        help="where run directories go; on several nodes it must be a shared filesystem",
    )
    p.add_argument("--name", help="run directory name under --storage-path (default: basename of output.out_dir)")
    p.add_argument("--resume", default="", help="'auto' to continue the run directory's newest checkpoint, or a path")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts Ray Train may do")
    p.add_argument("--coordinator-restarts", type=int, default=5, help="restarts of the plan actor Ray may do")
    p.add_argument(
        "--check",
        action="store_true",
        help="only check the config, these arguments and that the job's workers will find every path the run "
        "names (shipped with --working-dir, see cluster/job_paths.py), print where the run's files will be, and "
        "exit: 0, or 2 with one error line (launcher/ray_submit.sh runs this before it submits anything)",
    )
    p.add_argument("--working-dir", default=".", help="with --check: the working dir the job is submitted with")
    p.add_argument(
        "--runtime-env", default=RUNTIME_ENV, help="with --check: the runtime env file the job is submitted with"
    )
    return p


def resolve(args) -> RunConfig:
    """The run's config with the Ray-specific choices applied; ValueError on a bad argument."""
    if args.num_workers < 1:
        raise ValueError(f"--num-workers ({args.num_workers}) must be >= 1")
    if args.max_failures < 0 or args.coordinator_restarts < 0:
        raise ValueError(
            f"--max-failures ({args.max_failures}) and --coordinator-restarts "
            f"({args.coordinator_restarts}) must be >= 0"
        )
    config = prepare_run(load_config(args.config, args.overrides))
    check_world(config, args.num_workers)  # the workers' WORLD_SIZE is not known when the config loads
    name = args.name or Path(config.output.out_dir).name
    out_dir = Path(args.storage_path).expanduser().resolve() / name
    config.output.out_dir = str(out_dir)
    config.output.resume = args.resume or config.output.resume
    if not config.output.resume:
        check_fresh(out_dir)
    return config


def check_fresh(out_dir: Path) -> None:
    """Workers always resume 'auto' after a restart, so a fresh run must not find an older run's files."""
    found = [p.name for p in (out_dir / "metrics.jsonl", out_dir / "checkpoints") if p.exists()]
    if found:
        raise ValueError(
            f"run directory {out_dir} already holds {', '.join(found)} of an earlier run: "
            "pass --resume auto to continue it, or another --name"
        )


def trainer_for(config: RunConfig, args, run_name: str):
    train = import_ray("ray.train")
    torch_train = import_ray("ray.train.torch")
    out_dir = Path(config.output.out_dir)
    return torch_train.TorchTrainer(
        train_worker,
        train_loop_config={"config": config, "run_name": run_name},
        torch_config=torch_train.TorchConfig(
            backend="nccl" if args.use_gpu else "gloo", timeout_s=int(config.parallel.timeout_s)
        ),
        scaling_config=train.ScalingConfig(
            num_workers=args.num_workers,
            use_gpu=args.use_gpu,
            resources_per_worker={"CPU": args.cpus_per_worker, **({"GPU": 1} if args.use_gpu else {})},
        ),
        run_config=train.RunConfig(
            name=out_dir.name,
            storage_path=str(out_dir.parent),
            failure_config=train.FailureConfig(max_failures=args.max_failures),
        ),
    )


def wants_actor(config: RunConfig) -> bool:
    return config.adaptive.enabled and config.parallel.coordinator in ("auto", "ray")


def launch(config: RunConfig, args) -> Dict:
    ray = import_ray()
    ray.init(namespace=NAMESPACE)  # under `ray job submit`, RAY_ADDRESS points at the job's cluster
    run_name = f"{Path(config.output.out_dir).name}-{ray.get_runtime_context().get_job_id()}"
    actor = None
    if wants_actor(config):
        actor = start_plan_actor(
            run_name, args.num_workers, args.coordinator_restarts, config.fault.coordinator_crash_version
        )
        ray.get(actor.info.remote())  # up before the workers look it up by name
    started = time.perf_counter()
    clear_worker_errors(config.output.out_dir)  # left by an earlier attempt under this name
    trainer_for(config, args, run_name).fit()
    wall_s = time.perf_counter() - started
    if worker_errors(config.output.out_dir):
        return {}
    restarts = actor_restarts(actor_name(run_name)) if actor is not None else None
    return summarize(Path(config.output.out_dir), wall_s, restarts)


def actor_restarts(name: str) -> Optional[int]:
    """How often Ray restarted the plan actor (state API); None if the state API could not tell."""
    state = import_ray("ray.util.state")
    found = state.list_actors(filters=[("name", "=", name)], detail=True, raise_on_missing_output=False)
    return max((a.num_restarts for a in found), default=None)


def read_records(out_dir: Path) -> List[Dict]:
    path = out_dir / METRICS_FILE
    return read_metrics(path) if path.exists() else []


def final_record(out_dir: Path, records: List[Dict]) -> Dict:
    """The run's last final record (a resumed run repeats some steps: the last attempt counts)."""
    finals = [r for r in records if r["kind"] == "final"]
    if not finals:
        raise RuntimeError(f"the job ended without a final record in {out_dir / 'metrics.jsonl'}")
    return finals[-1]


def summarize(out_dir: Path, wall_s: float, coordinator_restarts: Optional[int]) -> Dict:
    """The job's figures from metrics.jsonl (a resumed run repeats some steps: the last attempt counts)."""
    records = read_records(out_dir)
    final = final_record(out_dir, records)
    step_s = {r["step"]: r["step_s"] for r in records if r["kind"] == "step"}
    events = [
        {k: r[k] for k in ("version", "step", "layer", "removed", "added", "num_experts", "planned_by")}
        for r in records
        if r["kind"] == "event"
    ]
    starts = worker_starts(str(out_dir))
    return {
        "out_dir": str(out_dir),
        "steps": final["step"],
        "wall_s": wall_s,
        "job_steps_per_s": final["step"] / wall_s,
        "train_steps_per_s": len(step_s) / sum(step_s.values()),
        "test_accuracy": final.get("test_accuracy"),
        "test_loss": final.get("test_loss"),
        "num_experts": final.get("num_experts"),
        "num_events": len(events),
        "planned_by": sorted({e["planned_by"] for e in events}),
        "events": events,
        "coordinator_restarts": coordinator_restarts,
        "worker_group_starts": max((len(s) for s in starts.values()), default=0),
        "worker_nodes": sorted({s[-1]["node_ip"] for s in starts.values()}),
    }


def run_summary(config: RunConfig) -> str:
    """What torchrun prints at the end (train/cli.summary): the final scores, the experts, and where the
    report, the newest checkpoint and the export command are; from the files the workers left."""
    out_dir = Path(config.output.out_dir)
    report = out_dir / "report.png"
    files = finished_files(str(out_dir), config.model.source == "hf", report if report.is_file() else None)
    return summary(final_record(out_dir, read_records(out_dir)) | files, str(out_dir))


def output_line(config: RunConfig) -> str:
    return f"dynmoe ray: the run's files go to {config.output.out_dir} (--storage-path/--name)"


def error_line(err: object) -> str:
    """The same one line as `dynmoe-train` prints for a mistake."""
    return f"dynmoe-train: error: {one_line(err)}"


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        if not args.check:
            import_ray("ray.train.torch")
        config = resolve(args)
        if args.check:
            check_job_paths(config, args.config, Path(args.working_dir), Path(args.runtime_env))
    except (RayMissing, ValueError) as err:
        print(error_line(err), file=sys.stderr, flush=True)
        return USAGE_ERROR
    if args.check:
        print(output_line(config), flush=True)
        return 0
    figures = launch(config, args)
    errors = worker_errors(config.output.out_dir)
    if errors:  # a mistake only the running workers could see (the token cache, a checkpoint)
        print(errors[min(errors)], file=sys.stderr, flush=True)
        return USAGE_ERROR
    (Path(config.output.out_dir) / SUMMARY_FILE).write_text(json.dumps(figures, indent=1) + "\n")
    print("dynmoe ray summary: " + json.dumps({k: v for k, v in figures.items() if k != "events"}), flush=True)
    print(run_summary(config), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
