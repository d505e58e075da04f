"""The project's commands run as a user runs them, in a subprocess: `python -m dynmoe_dist.export` on a
finished run (a later layer than bench/ and experiments/, tests/unit/test_layering.py), and the benchmarks
an experiment times its results with (a fresh process whose remote code is imported from the export
itself). Used by `bench generate --build` and by pretrain-moe / moe-finetune (experiments/moe_runs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence

COMMAND_TIMEOUT_S = 1800.0


class CommandFailed(RuntimeError):
    """A command exited non-zero; the message is its last lines of output."""


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
