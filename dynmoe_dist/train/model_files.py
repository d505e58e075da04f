"""The checkpoint part that makes a checkpoint self-contained: ``model/`` and the base it names.

Every weight of a run is in its checkpoint (experts by logical id, the dense state, frozen parameters
included: ``model.freeze`` stops their training, not their saving), but for a LoRA run's frozen base, which
its resume and export read from model.path, the hash below checked (train/checkpoint_base.py).
What else an export needs is written here, by rank 0, into ``step_N/model/``: the base's config files as
model.path has them (a transformers source's ``save_definition``) and the run's tokenizer, with
task.chat_template's template when set.
``python -m dynmoe_dist.export`` builds the model from those files without weights and fills it from the
checkpoint, so it needs nothing outside the checkpoint.

A resumed run does read model.path again (it builds the model from it before the checkpoint's weights
replace its parameters; buffers such as rotary frequencies come from its config). So the entry names the
base the run was trained from by path and content hash (xxh3-128 over its config and weight files,
``data.fingerprint.content_digest``), and a resume from a base whose content differs fails in one line
naming both hashes and the path; one whose content is the same resumes wherever model.path now points (the
architecture check leaves model.path to the hash). The entry also holds the hash of ``model/`` itself, which the export
checks before it builds from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ..config import RunConfig
from ..data.fingerprint import content_digest
from ..models.source import ModelSource
from ..parallel.groups import ParallelGroups, broadcast_object
from .dense_state import CheckpointError

MODEL_DIR = "model"


def tokenizer_path(config: RunConfig) -> str:
    """The tokenizer a run's task used: task.tokenizer, else the model's own at model.path."""
    return config.task.tokenizer or config.model.path


def files_digest(files: List[Path]) -> str:
    """One xxh3-128 over the files' names and content hashes, in name order."""
    import xxhash

    digest = xxhash.xxh3_128()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(f"{path.name}\0{content_digest(path)}\n".encode())
    return digest.hexdigest()


class ModelFiles:
    """``OwnFiles`` part (train/checkpoint.py): ``model/`` and the base's name and hash."""

    def __init__(self, source: ModelSource, config: RunConfig, groups: ParallelGroups):
        self.source = source
        self.base_path = config.model.path
        self.tokenizer_path = tokenizer_path(config)
        # The template a chat run rendered its conversations with (task.chat_template, read once at the start):
        # saved with the tokenizer, so the export formats a conversation as the model learnt it.
        template = config.task.chat_template
        self.chat_template = Path(template).expanduser().read_text(encoding="utf-8") if template else None
        self.groups = groups
        self._base_digest: Optional[str] = None

    def base(self) -> Optional[Dict[str, str]]:
        """The base the run was trained from: model.path and its content hash (None: no files define it)."""
        files = self.source.base_files()
        if not files:
            return None
        if self._base_digest is None:  # hashed once per run (a resume checks it, and keeps it)
            self._base_digest = files_digest(files)
        return {"path": self.base_path, "digest": self._base_digest}

    def save_files(self, directory: Path) -> Dict[str, Any]:
        if self.groups.rank != 0:
            return {}  # rank 0's entry is the one meta.pt keeps
        base = self.base()
        if base is None:
            return {"base": None, "definition": None}
        target = directory / MODEL_DIR
        self.source.save_definition(target)
        from ..data.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path, "task.tokenizer")
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        tokenizer.save_pretrained(str(target))
        return {"base": base, "definition": definition_digest(target)}

    def load_files(self, directory: Path, entry: Dict[str, Any]) -> None:
        """The base at model.path must be the one the checkpoint was trained from: rank 0 hashes it (the base
        is read once, not once per rank) and every rank compares, so every rank fails alike."""
        saved = entry.get("base")
        if saved is None:
            return
        current = broadcast_object(self.base() if self.groups.rank == 0 else None, self.groups, "base content hash")
        if current is None or current["digest"] != saved["digest"]:
            have = current["digest"] if current else "no files"
            raise CheckpointError(
                f"checkpoint {directory} was trained from a base with content {saved['digest']} "
                f"(model.path {saved['path']!r}); model.path ({self.base_path!r}) has content {have}"
            )


def definition_digest(directory: Path) -> str:
    return files_digest([p for p in directory.iterdir() if p.is_file()])


def checked_definition(checkpoint: Path, entry: Optional[Dict[str, Any]]) -> Optional[Path]:
    """``checkpoint/model/`` when the checkpoint holds one, its content checked against the hash written with
    it (ValueError naming both and the path); None for a checkpoint without (older, or a built-in model)."""
    if not entry or not entry.get("definition"):
        return None
    directory = checkpoint / MODEL_DIR
    have = definition_digest(directory) if directory.is_dir() else "no files"
    if have != entry["definition"]:
        raise ValueError(
            f"{directory}: the model definition has content {have}, the checkpoint was written with "
            f"{entry['definition']}"
        )
    return directory


def checked_base(entry: Optional[Dict[str, Any]], path: str) -> None:
    """The base at ``path`` must be the one the checkpoint was trained from (what an unmerged adapter applies
    to): a one-line ValueError naming both content hashes and the path otherwise."""
    from ..models.source import base_files

    saved = (entry or {}).get("base")
    if saved is None:
        raise ValueError(f"the checkpoint names no base to check model.path ({path!r}) against")
    have = files_digest(base_files(path)) if Path(path).expanduser().exists() else "no files"
    if have != saved["digest"]:
        raise ValueError(
            f"model.path ({path!r}) has content {have}; the checkpoint was trained from a base with content "
            f"{saved['digest']} (model.path {saved['path']!r})"
        )
