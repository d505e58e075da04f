"""A stock transformers MoE checkpoint at another top-k, as a user of transformers would run it: a directory
whose files are links to the checkpoint's, but for config.json, copied with num_experts_per_tok changed (no
weight is copied). moe-frontier finetunes the native top-1 and top-3 of a pre-trained top-2 model from such
views; `bench generate --build` times the native top-k/2 against the native top-k."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Callable


def model_with_k(model: Path, k: int, views: Path) -> Path:
    """``model`` itself when k is its own top-k (or 0); otherwise views/kK: every file of ``model`` linked, and
    config.json copied with num_experts_per_tok = k. Rewritten on every call (a changed model is followed)."""
    config = json.loads((model / "config.json").read_text())
    if k in (0, config["num_experts_per_tok"]):
        return model
    view = views / f"k{k}"
    view.mkdir(parents=True, exist_ok=True)
    for file in model.iterdir():
        link = view / file.name
        if (
            file.is_file()
            and file.name != "config.json"
            and not (link.is_symlink() and link.resolve() == file.resolve())
        ):
            _replace(link, functools.partial(_link_to, file.resolve()))
    text = json.dumps({**config, "num_experts_per_tok": k}, indent=2)
    if not (view / "config.json").is_file() or (view / "config.json").read_text() != text:
        _replace(view / "config.json", lambda temp: temp.write_text(text))
    return view


def _link_to(target: Path, link: Path) -> None:
    link.symlink_to(target)


def _replace(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a temporary sibling, then rename it over ``path``: commands run side by side (--seed-list) read
    a whole file or the old one, never a half-written one."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.unlink(missing_ok=True)
    write(temp)
    os.replace(temp, path)
