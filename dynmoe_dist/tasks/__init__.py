"""Built-in tasks. ``build_task(config.task)`` looks the name up in the registry."""

from typing import Dict

from . import (
    causal_lm,  # noqa: F401  (registers 'causal-lm'; transformers is imported only when it is built)
    chat,  # noqa: F401  (registers 'chat')
    synthetic,  # noqa: F401  (registers 'synthetic')
)
from .base import TASK_OPTIONS, TASK_SPECS, TASKS, Batch, Task, TaskSpec, register, split_indices

OPTIONAL_MODULES = ("text", "vision")
# module -> the missing package that kept it from loading, for the unknown-task message
_unavailable: Dict[str, str] = {}


def _load_optional():
    # Real-data tasks need the 'data' extra; importing them lazily keeps the core installable alone.
    import importlib

    for module in OPTIONAL_MODULES:
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith(f"{__name__}."):
                continue
            _unavailable[module] = err.name or str(err)


def task_spec(name: str) -> TaskSpec:
    """The registered task called ``name``; ValueError listing the valid names otherwise."""
    _load_optional()
    if name in TASK_SPECS:
        return TASK_SPECS[name]
    missing = "".join(
        f"; tasks/{m}.py did not load (no module {p!r}: pip install -e '.[data]' in the checkout)"
        for m, p in sorted(_unavailable.items())
    )
    raise ValueError(f"task.name ({name!r}) must be one of {sorted(TASK_SPECS)}{missing}")


def all_task_specs() -> Dict[str, TaskSpec]:
    """Every task that could load (the optional ones need the 'data' extra), by name: what --help lists."""
    _load_optional()
    return dict(sorted(TASK_SPECS.items()))


def build_task(task_config) -> Task:
    return task_spec(task_config.name).build(task_config)


def validate_run_config(run_config) -> None:
    """The task's name and its own checks (model shapes it can build, files it needs), before any data."""
    spec = task_spec(run_config.task.name)
    if spec.validate is not None:
        spec.validate(run_config)


__all__ = [
    "TASKS",
    "TASK_OPTIONS",
    "TASK_SPECS",
    "Batch",
    "Task",
    "TaskSpec",
    "all_task_specs",
    "build_task",
    "register",
    "split_indices",
    "task_spec",
    "validate_run_config",
]
