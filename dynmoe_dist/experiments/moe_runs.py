"""What `pretrain-moe` and `moe-finetune` share: runs on simulated ranks, and the two commands they call
on a finished run, `python -m dynmoe_dist.export` and `python -m dynmoe_dist.bench generate`.

The commands run as subprocesses, the way a user runs them: the export is a later layer than
experiments/ (tests/unit/test_layering.py), and generation timing wants a fresh process whose remote
code is imported from the export itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

RUN_TIMEOUT_S = 7 * 24 * 3600.0
"""No overall deadline worth having for one training run; collectives still time out on their own."""
COMMAND_TIMEOUT_S = 1800.0


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


class CommandFailed(RuntimeError):
    """A command this experiment runs exited non-zero; the message is its last lines of output."""


def run_command(args: Sequence[str], env: Dict[str, str]) -> str:
    """stdout of ``python -m ARGS`` (offline: the hub is never asked); CommandFailed with the tail of
    stderr when it fails."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env}
    done = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, env=full_env, timeout=COMMAND_TIMEOUT_S
    )
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise CommandFailed(f"python -m {' '.join(args[:2])} exited {done.returncode}: {tail}")
    return done.stdout


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """`python -m dynmoe_dist.export CHECKPOINT --out OUT`: a native-routing run in the model's stock format,
    a top-any run as a remote-code directory."""
    run_command(["dynmoe_dist.export", str(checkpoint), "--out", str(out)], {})
    return out


def last_json(stdout: str) -> Dict[str, Any]:
    """The last line of a command's stdout that is a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise CommandFailed(f"no JSON line in the command's output: {stdout[-200:]!r}")


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
