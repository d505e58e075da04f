"""The two checkpoint parts that keep their bulk in files of their own inside ``step_N/`` (the others live in
meta.pt): the expert set and the dense state. Both follow train/checkpoint.py's ``OwnFiles`` protocol:
``save_files(directory)`` writes (collective) and returns the part's small entry for meta.pt;
``load_files(directory, entry)`` reads it back (collective), resharded to how this run holds it.

  experts_ep{r}.pt  the experts owned by ep rank r (``Placement.owner``): weights and Adam state by
                    'layer/logical id', written by the ranks of the first dp group; a resuming rank reads
                    only the files whose owners hold experts it will hold
  dense/            dense parameters (routers included) and their Adam state, a torch.distributed.checkpoint
                    directory (train/dense_state.py): each rank writes its own FSDP shard, DCP reshards
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict

import torch
from torch.optim import Optimizer

from ..parallel.groups import ParallelGroups
from ..parallel.reshard import owner_files_needed
from .dense_state import DENSE_DIR, CheckpointError, NamedParams, load_dense, save_dense
from .experts import ExpertPayload, ExpertSet, saved_placements


def load_file(path: Path) -> Any:
    """A checkpoint file of tensors and plain containers (``weights_only``: no arbitrary pickle)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt or not a checkpoint
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {err}") from err


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def expert_file(directory: Path, ep_rank: int) -> Path:
    return directory / f"experts_ep{ep_rank}.pt"


class ExpertFiles:
    """The expert set as a checkpoint part: its layout (placements, discarded experts) in meta.pt, its
    experts in the owners' files."""

    def __init__(self, experts: ExpertSet, groups: ParallelGroups):
        self.experts = experts
        self.groups = groups

    def save_files(self, directory: Path) -> Dict[str, Any]:
        # Experts are written by their owners as logical tensors: only the ranks that write them copy them to
        # the host, and under expert FSDP every rank of the expert-dp group takes part in gathering them
        # (full_tensor is a collective).
        writes = self.groups.dp_rank == 0
        if writes or self.experts.sharded:
            owned = self.experts.owned_experts()
            if writes:
                atomic_save(owned, expert_file(directory, self.groups.ep_rank))
        return self.experts.layout()

    def load_files(self, directory: Path, entry: Dict[str, Any]) -> None:
        saved = saved_placements(entry)
        needed = owner_files_needed(saved, self.experts.resume_placements(entry), self.groups.ep_rank)
        payload: ExpertPayload = {}
        for owner in needed:
            payload.update(load_file(expert_file(directory, owner)))
        self.experts.load_state_dict({**entry, "experts": payload})


class DenseFiles:
    """The dense half (every parameter that is not an expert's, routers included, and its Adam state) as a
    checkpoint part: one DCP directory. ``params`` is called at save and load time: which parameters are
    dense changes with the expert set (routers are replaced at every event)."""

    def __init__(self, params: Callable[[], NamedParams], optimizer: Optimizer, groups: ParallelGroups):
        self.params = params
        self.optimizer = optimizer
        self.groups = groups

    def save_files(self, directory: Path) -> Dict[str, Any]:
        save_dense(directory / DENSE_DIR, self.params(), self.optimizer, self.groups)
        return {}

    def load_files(self, directory: Path, entry: Dict[str, Any]) -> None:
        load_dense(dense_directory(directory), self.params(), self.optimizer, self.groups)


def dense_directory(checkpoint: Path) -> Path:
    """The checkpoint's DCP directory of dense state; the older one-file layout is refused by name."""
    directory = checkpoint / DENSE_DIR
    if not directory.is_dir():
        old = checkpoint / "dense.pt"
        if old.is_file():
            raise CheckpointError(
                f"checkpoint file {old} is in the old format (one dense.pt); the dense state is now a "
                f"torch.distributed.checkpoint directory {DENSE_DIR}/: resume with the version that wrote it"
            )
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    return directory
