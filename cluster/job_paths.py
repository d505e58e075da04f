"""Will the workers of a Ray job find the files its run file names? Checked before anything is submitted.

A job runs in Ray's unpacked copy of the working dir (``ray job submit --working-dir .``), on machines that
may not be this one. A relative path (the config file, model.path, task.path, task.test_path, task.tokenizer,
task.chat_template, output.resume) is read from that copy, so it must be inside the working dir and uploaded:
not left out by the runtime env's ``excludes`` (cluster/runtime_env.yaml) nor by a ``.gitignore`` or
``.rayignore`` on its way (Ray's own upload rules, applied here with Ray's own matchers). ``runs/`` is left
out (it holds checkpoints), so a model trained into ``runs/`` must be named by an absolute path on
storage every node reads at the same place (with ``--local`` every worker is on this machine, so its
absolute path here is such a path). An absolute path (or ~, each node's home) is taken as such: whether
other nodes mount it cannot be seen from here. ``package:NAME`` and built-in corpora are not files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Set, Tuple

from dynmoe_dist.cluster import import_ray

from dynmoe_dist.config import RunConfig
from dynmoe_dist.data.sources import BUILTIN_CORPORA

# The upload skips .gitignore'd files unless this Ray variable is "1" (ray._private.ray_constants).
IGNORE_GITIGNORE_ENV = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"
# Ray's matchers log each ignore file they read at INFO (the upload itself says so once): not here.
QUIET = logging.getLogger(__name__)
QUIET.setLevel(logging.WARNING)


def named_paths(config: RunConfig, config_file: Optional[str]) -> List[Tuple[str, str]]:
    """(option, path as written) of every file or folder the job reads, in the order a user reads them."""
    named = [
        ("--config", config_file or ""),
        ("model.path", config.model.path),
        ("task.tokenizer", config.task.tokenizer),
        ("task.path", config.task.path),
        ("task.test_path", config.task.test_path),
        ("task.chat_template", config.task.chat_template),
        ("output.resume", "" if config.output.resume == "auto" else config.output.resume),
    ]
    return [(option, value) for option, value in named if is_file_path(value)]


def is_file_path(value: str) -> bool:
    return bool(value) and not value.startswith("package:") and value not in BUILTIN_CORPORA


def upload_excludes(runtime_env_file: Path) -> List[str]:
    """The ``excludes`` patterns of a runtime env file ([] without the file or the key)."""
    if not runtime_env_file.is_file():
        return []
    yaml = import_ray("yaml")  # PyYAML comes with Ray
    env = yaml.safe_load(runtime_env_file.read_text()) or {}
    return [str(pattern) for pattern in env.get("excludes") or []]


def left_out_by(relative: Path, root: Path, excludes: Sequence[str]) -> Optional[Path]:
    """The first folder or file on the way from ``root`` to ``root/relative``, or inside it, that the upload
    leaves out (the runtime env's excludes, and the .gitignore / .rayignore of each folder on the way, as
    Ray's packaging walks the tree), or None when the upload holds all of it."""
    packaging = import_ray("ray._private.runtime_env.packaging")
    include_gitignore = os.environ.get(IGNORE_GITIGNORE_ENV, "0") != "1"
    rules: List[Callable[[Path], bool]] = [packaging._get_excludes(root, list(excludes))] if excludes else []
    path = root
    for part in relative.parts:
        rules += packaging.get_excludes_from_ignore_files(path, include_gitignore=include_gitignore, logger=QUIET)
        path = path / part
        if any(rule(path) for rule in rules):
            return path.relative_to(root)
    if not path.is_dir():
        return None
    shipped: Set[Path] = set()  # a folder's own entry may be uploaded while its files are not ('runs/')
    packaging._dir_travel(path, rules, shipped.add, include_gitignore=include_gitignore, logger=QUIET)
    dropped = sorted(p for p in path.rglob("*") if p.is_file() and p not in shipped)
    return dropped[0].relative_to(root) if dropped else None


def unshipped(option: str, value: str, root: Path, excludes: Sequence[str]) -> str:
    """Why the workers will not find ``value`` ('' when they will)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return ""
    absolute = (root / path).resolve()
    if not absolute.is_relative_to(root):
        return f"is outside the working dir ({root}) that the job ships"
    dropped = left_out_by(absolute.relative_to(root), root, excludes)
    if dropped is None:
        return ""
    return (
        f"is not shipped with the job: {dropped}{'/' if (root / dropped).is_dir() else ''} is left out of its "
        "upload (by the runtime env's excludes or a .gitignore / .rayignore)"
    )


def check_job_paths(config: RunConfig, config_file: Optional[str], root: Path, runtime_env_file: Path) -> None:
    """A ValueError, one line, for the first path the job's workers would not find, saying what to do."""
    root = root.resolve()
    excludes = upload_excludes(runtime_env_file)
    for option, value in named_paths(config, config_file):
        why = unshipped(option, value, root, excludes)
        if why:
            here = Path(value).expanduser().resolve()
            fix = f"--set {option}={here}" if option != "--config" else f"--config {here}"
            raise ValueError(
                f"{option} ({value!r}) {why}: name it by an absolute path that every node reads at the same "
                f"place (shared storage; with --local this machine's): {fix}"
            )
