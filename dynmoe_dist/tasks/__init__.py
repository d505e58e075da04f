"""Built-in tasks. ``build_task(config.task)`` looks the name up in the registry."""

from .base import TASKS, Batch, Task, register, split_indices
from . import synthetic  # noqa: F401  (registers 'synthetic')
from . import causal_lm  # noqa: F401  (registers 'causal-lm'; transformers is imported only when it is built)


def _load_optional():
    # Real-data tasks need the 'data' extra; importing them lazily keeps the core installable alone.
    import importlib
    for module in ("text", "vision"):
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith(f"{__name__}."):
                continue
            raise


def build_task(task_config) -> Task:
    _load_optional()
    if task_config.name not in TASKS:
        raise ValueError(f"task.name ({task_config.name!r}) must be one of {sorted(TASKS)}")
    return TASKS[task_config.name](task_config)


__all__ = ["TASKS", "Batch", "Task", "build_task", "register", "split_indices"]
