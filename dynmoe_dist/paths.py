"""How paths in run files and on the command line are read, and how errors show them.

Every relative path (the config file, task.path, task.test_path, task.tokenizer, model.path,
output.out_dir, output.resume) is resolved from the directory the command runs in, not from the
config file's directory: the same rule as the shell's. An error about a relative path therefore shows
both the path as written and where it was looked for.
"""

from __future__ import annotations

from pathlib import Path

RELATIVE_PATH_RULE = "relative paths are read from the directory the command runs in"


def shown_path(value: str) -> str:
    """'tiny_qwen2' -> "'tiny_qwen2' = /home/me/runs/tiny_qwen2"; a path that is already absolute (or ~-less
    and unchanged by resolving) is shown as written."""
    resolved = str(Path(value).expanduser().resolve())
    return repr(value) if resolved == value else f"{value!r} = {resolved}"


def missing(option: str, value: str, problem: str = "does not exist") -> ValueError:
    """The error for a path option whose file or directory is not there, with the resolved path and,
    for a relative one, the rule that resolved it."""
    rule = "" if Path(value).expanduser().is_absolute() else f" ({RELATIVE_PATH_RULE})"
    return ValueError(f"{option} ({shown_path(value)}) {problem}{rule}")
