"""What `pretrain-moe` and `moe-finetune` share: runs on simulated ranks, and the two commands they call
on a finished run, `python -m dynmoe_dist.export` and `python -m dynmoe_dist.bench generate`, as
subprocesses (bench/commands.py runs them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

from ..bench.commands import last_json, run_command

RUN_TIMEOUT_S = 7 * 24 * 3600.0
"""No overall deadline worth having for one training run; collectives still time out on their own."""


def log(message: str) -> None:
    """Progress of a long experiment, on stderr: stdout carries the one JSON line."""
    print(message, file=sys.stderr, flush=True)


def simulated(fn: Callable[..., Any], world_size: int, args: Sequence[Any]) -> List[Any]:
    """fn(*args) on world_size gloo ranks (one process each, one thread each); results in rank order. One
    rank runs in this process, without a process group (what --world-size 1 asks for: no start-up cost)."""
    if world_size == 1:
        return [fn(*args)]
    from ..parallel.simulate import run_simulated

    return run_simulated(fn, world_size, args=tuple(args), timeout_s=RUN_TIMEOUT_S, collective_timeout_s=600.0)


def generation_ms(export: Path, base: Path, threads: int, repeats: int, modules_cache: Path) -> Dict[str, float]:
    """Per-token decode time of an export and of the pre-trained base, from one `bench generate` (the runs
    alternate, so load from other processes hits both alike): {'per_token_ms', 'base_per_token_ms'}."""
    args = ["dynmoe_dist.bench", "generate", "--model", str(export), "--base", str(base)]
    args += ["--threads", str(threads), "--repeats", str(repeats)]
    # Each export's remote code goes into its own modules cache (same module names, other code).
    result = last_json(run_command(args, {"HF_MODULES_CACHE": str(modules_cache)}))
    cases = result["cases"]  # bench generate calls the base model "dense"
    return {
        "per_token_ms": float(cases["moe"]["per_token_ms_median"]),
        "base_per_token_ms": float(cases["dense"]["per_token_ms_median"]),
    }
