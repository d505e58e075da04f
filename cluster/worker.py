"""What every Ray Train worker runs: the ordinary training job, with the Ray coordinator injected.

Ray Train has already formed the torch.distributed group (gloo or nccl; ``init_groups`` reuses it) and set
RANK / WORLD_SIZE / LOCAL_RANK. Training tensors only ever travel through that group; Ray carries the
window statistics and plans (``coordinator.py``) and nothing else.

Kept apart from ``submit.py`` because the driver runs as ``__main__``, and Ray must find this function
by its module name on the workers.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Dict

from dynmoe_dist.cluster import import_ray
from dynmoe_dist.cluster.coordinator import coordinator_factory

WORKERS_DIR = "workers"


def record_worker_start(out_dir: str, rank: int, world_size: int, node_ip: str) -> None:
    """One line per start of each rank (rank{r}.jsonl): where it ran, and how often the group was restarted."""
    folder = Path(out_dir) / WORKERS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = {
        "rank": rank,
        "world_size": world_size,
        "node_ip": node_ip,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
    }
    with open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(line) + "\n")


def use_ray_gpu(ray) -> None:
    """init_groups takes the CUDA device index from LOCAL_RANK (torchrun's convention). Under Ray Train a
    worker's GPU is its position in the node's shared CUDA_VISIBLE_DEVICES (ray.train.torch.get_device()),
    which usually, but not necessarily, equals its local rank: hand init_groups Ray's index."""
    if ray.get_gpu_ids():
        os.environ["LOCAL_RANK"] = str(ray.train.torch.get_device().index)


def train_worker(loop_config: Dict) -> None:
    """Ray Train's train_loop_per_worker: loop_config = {"config": RunConfig, "run_name": str}."""
    ray = import_ray()
    import_ray("ray.train.torch")
    from dynmoe_dist.train.run import run  # after Ray Train set up the process group and the rank variables

    config = loop_config["config"]
    context = ray.train.get_context()
    record_worker_start(
        config.output.out_dir, context.get_world_rank(), context.get_world_size(), ray.util.get_node_ip_address()
    )
    use_ray_gpu(ray)
    # A restarted worker group continues from the newest complete checkpoint of this run (none at first).
    config.output.resume = config.output.resume or "auto"
    try:
        run(config, coordinator_factory=coordinator_factory(loop_config["run_name"], config.parallel.timeout_s))
    except ValueError as err:
        if os.environ.get("DYNMOE_TRACEBACK"):
            raise
        # A user mistake (a corpus without its text column, a corrupt checkpoint) would only recur if Ray
        # Train restarted the group: end this worker normally and leave the one line to the driver.
        record_worker_error(config.output.out_dir, context.get_world_rank(), err)


def error_file(out_dir: str, rank: int) -> Path:
    return Path(out_dir) / WORKERS_DIR / f"error-rank{rank}.txt"


def record_worker_error(out_dir: str, rank: int, err: ValueError) -> None:
    from dynmoe_dist.train.cli import one_line

    path = error_file(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"dynmoe-train: error: {one_line(err)}\n")


def worker_errors(out_dir: str) -> Dict[int, str]:
    """rank -> the error line a worker left (record_worker_error), from this attempt of the run."""
    found = {}
    for path in (Path(out_dir) / WORKERS_DIR).glob("error-rank*.txt"):
        rank = path.stem[len("error-rank") :]
        if rank.isdigit():
            found[int(rank)] = path.read_text().strip()
    return dict(sorted(found.items()))


def clear_worker_errors(out_dir: str) -> None:
    for path in (Path(out_dir) / WORKERS_DIR).glob("error-rank*.txt"):
        path.unlink()


def worker_starts(out_dir: str) -> Dict[int, list]:
    """rank -> the start records written by record_worker_start."""
    starts = {}
    for path in sorted((Path(out_dir) / WORKERS_DIR).glob("rank*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines:
            starts[lines[0]["rank"]] = lines
    return dict(sorted(starts.items()))
