"""Every module, file and name the prose mentions exists: docs/*.md, README.md, and the docstrings and
comments of the project's Python files (the code itself is checked by importing it).

Three kinds of mention are checked, statically (files parsed, nothing imported):
  file        ``train/checkpoint_parts.py``, ``docs/hf.md``, ``hf_tiny.py``, ``launcher/configs/demo.toml``: a
              repository file whose path ends so (a bare name: any file of that name); .py .md .toml .sh
              .jinja .yaml
  dotted      ``dynmoe_dist.models.source.fixed_options``: the longest prefix that is a module of the project,
              and the next name defined (or imported) at the top level of that module
  short       ``models.build.build_model``, ``train.step.train_step``: the same, read under ``dynmoe_dist.``,
              for a name that starts with a layer of tests/unit/test_layering.py's ORDER and is not a run
              option (``moe.router``, ``train.seed``: section and field of config.SECTIONS)
A mention that is meant to name something outside the repository goes in NOT_IN_REPO with the reason.
"""

import ast
import dataclasses
import io
import os
import re
import tokenize
from functools import lru_cache
from pathlib import Path
from typing import Iterator, List, Optional, Set, Tuple

from test_layering import ORDER

from dynmoe_dist.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
PYTHON_FOLDERS = ("dynmoe_dist", "kernels", "cluster", "launcher", "tests")
SKIPPED_FOLDERS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", "runs"}
# Mentions of files that are not in the repository, on purpose
NOT_IN_REPO = {
    "conversion_mapping.py": "transformers' module (how it fuses experts on load)",
    "deepspeed/moe/sharded_moe.py": "DeepSpeed's module, the dense dispatch bench dense_dispatch copies",
    "models/bert.py": "deleted on 2026-12-01; docs/hf.md and docs/results.md tell what it measured",
    "copy.py": "a file a docstring-corpus test writes into its temporary folder",
    "gpu_check.md": "written by make gpu-check into its output folder",
    "config.toml": "the run's config, written into its output folder",
}
# A mention in a run's output folder or under an upper-case placeholder (DIR/, OUT/) is an output; an
# upper-case run file or a my_ name (RUN.toml, my_run.toml) is the reader's own file.
OUTPUT = re.compile(r"^(?:[A-Z_]+|runs)/|^[A-Z_]+\.toml$|^my\w*\.\w+$")
# Layers whose name is also a common variable name: `config.model` is a RunConfig's field, `hf.config` a
# transformers model's; these are checked only in the dotted form.
VARIABLE_NAMES = {"config", "hf"}

FILE_MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|toml|sh|jinja|yaml))\b")
DOTTED_MENTION = re.compile(r"\bdynmoe_dist(?:\.\w+)+(?![\w/])")
SHORT_LAYERS = [layer for layer in ORDER if layer not in VARIABLE_NAMES]
SHORT_MENTION = re.compile(r"(?<![\w.])(?:" + "|".join(SHORT_LAYERS) + r")(?:\.\w+)+(?![\w/])")
NOT_A_NAME = {"py", "md", "json", "toml", "pt", "jsonl", "txt", "jinja", "sh", "yaml"}


def _python_prose(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings) of a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def prose() -> List[Tuple[str, str]]:
    """(where, text) of everything checked."""
    found = []
    for folder in PYTHON_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [(f"{path.relative_to(ROOT)}:{line}", text) for line, text in _python_prose(path)]
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        found += [(f"{path.relative_to(ROOT)}:{i}", line) for i, line in enumerate(path.read_text().splitlines(), 1)]
    return found


@lru_cache(maxsize=1)
def repository_files() -> Tuple[str, ...]:
    """Every file of the checkout (committed or not), the virtualenv and caches left out."""
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_FOLDERS]
        files += [(Path(folder) / name).relative_to(ROOT).as_posix() for name in names]
    return tuple(files)


def file_exists(mention: str) -> bool:
    return any(f == mention or f.endswith("/" + mention) for f in repository_files())


def module_path(parts: List[str]) -> Optional[Path]:
    """The file (or a namespace folder) of the module ``dynmoe_dist.<parts>``; None when there is none."""
    base = ROOT.joinpath(*parts)
    if parts[:2] in (["dynmoe_dist", "kernels"], ["dynmoe_dist", "cluster"]):  # installed from the root
        base = ROOT.joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if parts[:2] == ["dynmoe_dist", "kernels"] and base.is_dir():
        return base  # kernels/ has no __init__.py (a namespace package)
    return None


@lru_cache(maxsize=None)
def top_level_names(path: Path) -> Optional[Set[str]]:
    """Names a module defines or imports at its top level; None when a star import makes them unknowable."""
    if path.is_dir():
        return set()
    names: Set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def dotted_exists(parts: List[str]) -> bool:
    """``dynmoe_dist`` + ``parts``: the longest module prefix exists, and the name after it is defined there."""
    known = len(parts)
    while known > 1 and module_path(parts[:known]) is None:
        known -= 1
    if module_path(parts[:known]) is None:
        return False
    if known == len(parts):
        return True
    names = top_level_names(module_path(parts[:known]))
    return names is None or parts[known] in names


def run_options() -> Set[Tuple[str, str]]:
    return {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def dangling(where: str, text: str, options: Set[Tuple[str, str]]) -> List[str]:
    """The mentions in ``text`` that name nothing, as 'where: mention (what)'."""
    found = []
    for match in FILE_MENTION.finditer(text):
        mention = match.group(1)
        if mention in NOT_IN_REPO or OUTPUT.match(mention) or file_exists(mention):
            continue
        found.append(f"{where}: {mention} (no such file)")
    for match in DOTTED_MENTION.finditer(text):
        if not dotted_exists(match.group(0).split(".")):
            found.append(f"{where}: {match.group(0)} (no such module or name)")
    for match in SHORT_MENTION.finditer(text):
        parts = match.group(0).split(".")
        if parts[-1] in NOT_A_NAME or tuple(parts[:2]) in options:
            continue
        if not dotted_exists(["dynmoe_dist"] + parts):
            found.append(f"{where}: {match.group(0)} (no such module or name under dynmoe_dist)")
    return found


def test_every_module_file_and_name_the_prose_mentions_exists():
    options = run_options()
    offenders = [line for where, text in prose() for line in dangling(where, text, options)]
    assert not offenders, "\n".join(offenders)


def test_the_check_catches_each_kind_of_dangling_mention():
    options = run_options()
    text = (
        "Which files hold them is train/checkpoint_files.py's business (DESIGN.md, launcher/configs/nope.toml); "
        "see dynmoe_dist.models.source.no_such_function and models.build.build_modle, "
        "and dynmoe_dist.train.nowhere."
    )
    assert dangling("x", text, options) == [
        "x: train/checkpoint_files.py (no such file)",
        "x: DESIGN.md (no such file)",
        "x: launcher/configs/nope.toml (no such file)",
        "x: dynmoe_dist.models.source.no_such_function (no such module or name)",
        "x: dynmoe_dist.train.nowhere (no such module or name)",
        "x: models.build.build_modle (no such module or name under dynmoe_dist)",
    ]
    fine = (
        "train/checkpoint_parts.py, docs/hf.md, hf_tiny.py, dynmoe_dist.models.source.fixed_options, "
        "dynmoe_dist.kernels.grouped_gemm, models.build.build_model, moe.router, train.seed, config.model, "
        "OUT/results.md, conversion_mapping.py, dynmoe_dist.gpu_check/1, dynmoe_dist.hf.from_pretrained, "
        "launcher/configs/demo.toml, launcher/torchrun.sh, RUN.toml, my_run.toml"
    )
    assert dangling("x", fine, options) == []
