"""The lists `dynmoe-train --help` prints under some options, read from where each list is defined, so the
help cannot fall behind the code: the task registry (tasks/), the model sources and model.path forms
(config.py), and the rule for relative paths (paths.py)."""

from __future__ import annotations

from typing import Dict, List

from ..config import MODEL_PATH_FORMS, MODEL_SOURCE_HELP
from ..paths import RELATIVE_PATH_RULE
from ..tasks import all_task_specs


def option_choices() -> Dict[str, List[str]]:
    """option -> the lines listed under it in --help."""
    specs = all_task_specs()
    return {
        "task.name": [f"{name}: {spec.summary}" for name, spec in specs.items()],
        "task.path": [f"{name}: {spec.path_forms}" for name, spec in specs.items() if spec.path_forms],
        "model.source": [f"{name}: {meaning}" for name, meaning in MODEL_SOURCE_HELP.items()],
        "model.path": [f"{form}: {meaning}" for form, meaning in MODEL_PATH_FORMS.items()],
    }


def paths_note() -> str:
    return (
        f"Paths: {RELATIVE_PATH_RULE}, not from the config file's directory.\n"
        "A run writes to output.out_dir (default runs/latest): metrics.jsonl, report.png and\n"
        "checkpoints/step_N (what `python -m dynmoe_dist.export CHECKPOINT --out DIR` reads)."
    )
