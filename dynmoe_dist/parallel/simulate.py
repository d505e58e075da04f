"""A simulated cluster on one machine: N gloo (or, one GPU each, nccl) processes on 127.0.0.1, each
running the same function.

    results = run_simulated(fn, world_size=3, args=(...,))   # fn(*args) runs on every rank

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its environment and an
initialised gloo default group; ``fn`` must be importable (module level). The return values (picklable)
come back in rank order. A rank that raises makes the whole call raise with that rank's traceback; a
cluster that does not finish within ``timeout_s`` is killed and reported, never left hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class SimulationError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(
    fn: Callable[..., Any],
    args: Tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    collective_timeout_s: float,
    env: Dict[str, str],
    queue: Any,
    backend: str = "gloo",
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before NCCL picks one
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        # Plain pickle (not the queue's ForkingPickler): torch would otherwise share tensors through file
        # descriptors that die with this process if it exits before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report everything, including SystemExit from a CLI entry point
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a peer that already failed can make teardown fail; the result is sent
            pass


def run_simulated(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    env: Optional[Dict[str, str]] = None,
    backend: str = "gloo",
) -> List[Any]:
    """``backend='nccl'`` gives rank r the GPU r (the gpu-check runs the trainer that way)."""
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend ({backend!r}) must be 'gloo' or 'nccl'")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, tuple(args), r, world_size, port, collective_timeout_s, env, queue, backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(queue, procs, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(queue: Any, procs: List[Any], world_size: int, timeout_s: float) -> List[Any]:
    import queue as queue_mod
    import time

    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world_size:
        try:
            rank, status, payload = queue.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue_mod.Empty:
            dead = [
                i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and i not in results
            ]
            if dead and queue.empty():
                time.sleep(0.5)  # a rank may have queued its result just before exiting
            if dead and queue.empty():
                raise SimulationError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise SimulationError(
                    f"simulated cluster timed out after {timeout_s:g}s; ranks {missing} unfinished"
                ) from None
            continue
        if status == "error":
            raise SimulationError(f"rank {rank} failed:\n{payload}")
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(world_size)]
