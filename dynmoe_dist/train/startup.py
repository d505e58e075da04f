"""Start-up checks beyond what the config file says: options that would do nothing, extras not installed.

``prepare_run(config)`` runs once before training (the CLI calls it right after ``load_config``, which
has already raised for every mistake). It finds two things:

- an option the user set to a non-default value that the chosen task, router or adaptive setting never
  reads: a ``ConfigWarning`` naming the option and why (the CLI prints these once, on rank 0);
- a feature whose extra is not installed: turned off with a ``ConfigWarning`` when it is merely on by
  default (a bare ``pip install`` must still train), a ValueError naming the extra when the user asked
  for it by name.

"Set by the user" means the key was in the run file or a ``--set`` (``RunConfig.explicit``): a default
is never reported, and neither is an option set to its default value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from typing import Any, Dict, List, Tuple

from ..config import ADD_REMOVE_OPTIONS, SECTIONS, AdaptiveConfig, RunConfig
from ..moe.config import ROUTER_FIELDS
from ..tasks import TASK_OPTIONS, task_spec


class ConfigWarning(UserWarning):
    """An option that has no effect in this run, or an optional feature turned off."""


# option -> (top-level packages the feature imports, the extra that installs them)
OPTIONAL_FEATURES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "output.tensorboard": (("tensorboard",), "report"),
    "output.report": (("matplotlib",), "report"),
}


def option_value(config: RunConfig, option: str) -> Any:
    section, key = option.split(".")
    return getattr(getattr(config, section), key)


def declared_default(option: str) -> Any:
    section, key = option.split(".")
    spec = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def is_set(config: RunConfig, option: str) -> bool:
    """Set by the user (file or --set) to something other than the declared default."""
    return option in config.explicit and option_value(config, option) != declared_default(option)


# -- options that do nothing ----------------------------------------------------------------------


def task_unread(config: RunConfig) -> List[Tuple[str, str]]:
    """(option, why) for the task-dependent options this task does not read (as it declares)."""
    reads = task_spec(config.task.name).reads
    if reads is None:  # a task that declares nothing gets no warnings rather than wrong ones
        return []
    return [(option, f"task {config.task.name!r} does not read it") for option in sorted(TASK_OPTIONS - reads)]


def router_unread(config: RunConfig) -> List[Tuple[str, str]]:
    router = config.moe.router
    found = [
        (f"moe.{name}", f"only the {' / '.join(routers)} router reads it, and moe.router is {router!r}")
        for name, routers in ROUTER_FIELDS.items()
        if router not in routers
    ]
    if router != "top_any":
        found += [
            (
                option,
                f"only top_any layers add and remove experts (moe.router is {router!r}: adaptive "
                "events only re-place and replicate them)",
            )
            for option in ADD_REMOVE_OPTIONS
        ]
    return found


def adaptive_unread(config: RunConfig) -> List[Tuple[str, str]]:
    if config.adaptive.enabled:
        return []
    options = [f"adaptive.{f.name}" for f in dataclasses.fields(AdaptiveConfig) if f.name != "enabled"]
    return [(option, "adaptive.enabled is false") for option in options + ["moe.max_experts", "moe.min_experts"]]


def ignored_options(config: RunConfig) -> List[str]:
    """One message per option that the user set but that has no effect in this run."""
    found: Dict[str, str] = {}
    for option, why in task_unread(config) + router_unread(config) + adaptive_unread(config):
        if is_set(config, option):
            found.setdefault(option, why)
    return [f"{option} ({option_value(config, option)!r}) has no effect: {why}" for option, why in found.items()]


# -- optional extras ------------------------------------------------------------------------------


def missing_packages(packages: Tuple[str, ...]) -> List[str]:
    # find_spec locates a package without importing it (matplotlib and tensorboard are slow imports).
    return [name for name in packages if importlib.util.find_spec(name) is None]


def turned_off(config: RunConfig, option: str) -> RunConfig:
    section, key = option.split(".")
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{key: False})})


def resolve_optional_features(config: RunConfig) -> RunConfig:
    """Each optional feature that is on but lacks its extra: off with a warning if on by default,
    a ValueError naming the extra if the user set it."""
    for option, (packages, extra) in OPTIONAL_FEATURES.items():
        missing = missing_packages(packages) if option_value(config, option) else []
        if not missing:
            continue
        install = f"pip install -e '.[{extra}]' in the checkout"
        if option in config.explicit:
            raise ValueError(
                f"{option} (true) needs {', '.join(missing)}, which is not installed: {install} (or set {option}=false)"
            )
        warnings.warn(
            f"{option} turned off: {', '.join(missing)} is not installed ({install} to have it)",
            ConfigWarning,
            stacklevel=2,
        )
        config = turned_off(config, option)
    return config


def prepare_run(config: RunConfig) -> RunConfig:
    """The config a run should use: optional features resolved, unread options warned about."""
    config = resolve_optional_features(config)
    for message in ignored_options(config):
        warnings.warn(message, ConfigWarning, stacklevel=2)
    return config
