"""The files of an export folder: the weights as save_pretrained writes them, and a used folder emptied safely.

Weights: ``model.safetensors``, or above ``max_shard_size`` shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (huggingface_hub's ``save_torch_state_dict``, which cuts them with
``split_torch_state_dict_into_shards``, the helper transformers' ``save_pretrained`` uses). The default
size is save_pretrained's own.

Folder: an export goes into an empty or new folder. ``overwrite`` empties a used one first, but only one
that looks like an earlier export (a transformers model folder: config.json and files only, no subfolder),
and never one that holds the checkpoint being exported, the current directory or the home directory (so
not the filesystem root either): what it deletes are the files of an earlier export, nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from torch import Tensor

# transformers' save_pretrained default (5.x: "50GB"); tests/unit/test_export_folder.py checks they agree.
MAX_SHARD_SIZE = "50GB"


def shard_size_bytes(size: Union[int, str], option: str = "--max-shard-size") -> int:
    """'50GB', '500MB', '2KiB' or a byte count -> bytes; ValueError naming the option for anything else."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        found = int(size) if isinstance(size, int) or size.strip().isdigit() else parse_size_to_int(size)
    except ValueError:
        found = 0
    if found <= 0:
        raise ValueError(f"{option} ({size!r}) must be a positive size such as '50GB', '500MB' or a byte count")
    return found


def save_weights(state: Dict[str, Tensor], out: Path, max_shard_size: Union[int, str] = MAX_SHARD_SIZE) -> None:
    """``state`` (no shared storage: pretrained.unshared) into ``out`` as save_pretrained lays out weights."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(state, out, max_shard_size=shard_size_bytes(max_shard_size), metadata={"format": "pt"})


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refusal_to_empty(out: Path, checkpoint: Path) -> str:
    """Why ``out`` must not be emptied ('' when it may): see the module's docstring."""
    out, checkpoint = out.resolve(), checkpoint.resolve()
    for what, path in (("the checkpoint", checkpoint), ("the current directory", Path.cwd().resolve())):
        if _within(path, out):
            return f"it holds {what} ({path})"
    if _within(out, checkpoint):
        return f"it is inside the checkpoint ({checkpoint})"
    if _within(Path.home().resolve(), out):
        return "it holds the home directory"
    if not (out / "config.json").is_file():
        return "it holds no config.json, so it is no earlier export"
    folders = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.is_symlink())
    if folders:
        return f"it holds folders ({', '.join(folders[:3])}), which an export never writes"
    return ""


def prepare_out_dir(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """``out`` ready for an export: new, empty, or (``overwrite``) an earlier export emptied; a ValueError
    naming --out and what it holds otherwise."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out ({str(out)!r}) is a file, not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    listed = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    if not overwrite:
        raise ValueError(
            f"--out ({str(out)!r}) is not empty ({listed}): pass --overwrite to replace an earlier export there, "
            "or name a new folder"
        )
    why = refusal_to_empty(out, checkpoint)
    if why:
        raise ValueError(f"--overwrite: --out ({str(out)!r}) is not emptied: {why}; name a new folder")
    for path in out.iterdir():
        path.unlink()
