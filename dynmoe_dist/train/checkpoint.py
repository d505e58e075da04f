"""Checkpoints keyed by *logical* expert id, so a job resumes on any number of ranks or ep size, before or
after experts were added and removed.

Layout: ``OUT/checkpoints/step_000120/`` with
  meta.pt          config, placements, and the state_dict() of the trainer (step, RNG, data position),
                   the adaptive controller and the recorders (partial window statistics summed over ranks)
  dense/           dense parameters (routers included) and their Adam state, by parameter name: a
                   torch.distributed.checkpoint directory (train/dense_state.py) in which every rank
                   writes its own FSDP shard (nothing is gathered) and DCP reshards on load
  experts_ep{r}.pt the experts owned by ep rank r (``Placement.owner``): weights and optimizer state, by
                   'layer/logical id'; written by the ranks of the first dp group
The manager only composes: each part exposes ``state_dict()`` / ``load_state_dict()``, and resharding
experts by logical id is ``parallel.reshard``. A resuming rank reads only the expert files it needs.
Atomic: everything goes into ``step_000120.tmp/`` and rank 0 renames it when all ranks are done; the
previous checkpoint stays until then. Files hold only tensors and plain containers and are read with
``torch.load(weights_only=True)``, and DCP's pickled metadata with an allowlist (``SafeReader``): no
arbitrary pickle is ever loaded. Checkpoints of the older layout (one ``dense.pt``) are refused by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..config import DERIVED_MOE_KEYS, from_dict
from ..parallel.fsdp import full, shard_experts
from ..parallel.groups import barrier, sum_over_ranks
from ..parallel.reshard import (
    dense_named_parameters,
    local_expert_parameters,
    owned_expert_parameters,
    owner_files_needed,
    reshard,
    resume_placement,
)
from ..planning.placement import Placement
from .dense_state import DENSE_DIR, CheckpointError, load_dense, read_dense_params, read_metadata, save_dense
from .dense_state import saved_shapes as saved_dense_shapes
from .optim import ExpertOptimizerState, refresh_param_groups

STEP_DIR = re.compile(r"^step_(\d+)$")
ARCHITECTURE_SECTIONS = ("task", "model", "moe")


def checkpoint_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir: str) -> List[Path]:
    """Complete checkpoints (renamed from .tmp, meta present), oldest first."""
    root = checkpoint_root(out_dir)
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.pt").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def load_file(path: Path):
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt or not a checkpoint
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {err}") from err


def read_checkpoint_meta(checkpoint: Path):
    """(meta, the run's config) of a checkpoint directory, for readers outside the run (export, analyses)."""
    if not (checkpoint / "meta.pt").is_file():
        raise ValueError(f"CHECKPOINT ({str(checkpoint)!r}) is not a checkpoint directory (no meta.pt)")
    meta = load_file(checkpoint / "meta.pt")
    saved = json.loads(meta["config"])
    # The saved moe section holds the derived dim / ffn_dim, which a run file may not set.
    saved["moe"] = {k: v for k, v in saved.get("moe", {}).items() if k not in DERIVED_MOE_KEYS}
    return meta, from_dict(saved)


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


def read_checkpoint_dense(checkpoint: Path) -> Dict:
    """Dense parameters by name (routers included), as full tensors on this one process."""
    return read_dense_params(dense_directory(checkpoint))


def read_checkpoint_experts(checkpoint: Path) -> Dict[str, Dict]:
    """Experts by 'layer/logical id' (params and optimizer state), whatever the world size: every expert
    file is read, and a replicated expert was saved once."""
    experts: Dict[str, Dict] = {}
    for path in sorted(checkpoint.glob("experts_ep*.pt")):
        experts.update(load_file(path))
    return experts


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, trainer, adaptive=None):
        self.trainer = trainer
        self.adaptive = adaptive
        """The AdaptiveController when adaptive experts are on (its state is saved with the rest)."""

    def _expert_optimizer_state(self) -> ExpertOptimizerState:
        t = self.trainer
        return ExpertOptimizerState(t.optimizer, owned_expert_parameters(t.shards), local_expert_parameters(t.shards))

    # -- save --------------------------------------------------------------------------------------
    def save(self) -> Optional[Path]:
        t = self.trainer
        root = checkpoint_root(t.config.output.out_dir)
        final = root / f"step_{t.step:06d}"
        tmp = root / f"step_{t.step:06d}.tmp"
        window = self._summed_window()
        # Experts are written by their owners as logical tensors: only the ranks that write them copy them
        # to the host, and under expert FSDP every rank of the expert-dp group takes part in gathering
        # them (full_tensor is a collective). The dense state is never gathered: DCP writes each shard.
        writes_experts = t.groups.dp_rank == 0
        experts = (
            self._expert_payload(self._expert_optimizer_state().state_dict())
            if writes_experts or t.sharding.experts
            else None
        )
        if t.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier(t.groups, "checkpoint start")
        save_dense(tmp / DENSE_DIR, dense_named_parameters(t.model, t.shards), t.optimizer, t.groups)
        if t.is_rank0:
            atomic_save(self._meta_payload(window), tmp / "meta.pt")
        if t.groups.dp_rank == 0:
            atomic_save(experts, tmp / f"experts_ep{t.groups.ep_rank}.pt")
        barrier(t.groups, "checkpoint written")
        if t.is_rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune(t.config.output.keep_checkpoints)
        barrier(t.groups, "checkpoint committed")
        return final

    def _summed_window(self):
        """Partial window statistics summed over ranks (resume hands the sum to one rank)."""
        flat = self.trainer.recorders.state_dict()["window"]
        return (
            None
            if flat is None
            else sum_over_ranks(flat, self.trainer.groups, "checkpoint window statistics all_reduce")
        )

    # NOTE: device-to-host sync: checkpoints copy every expert tensor to the host (at checkpoint steps only).
    def _expert_payload(self, optimizer_experts: Dict) -> Dict:
        return {
            key: {
                "params": {n: full(p.detach()).cpu().clone() for n, p in params.items()},
                "state": optimizer_experts.get(key, {}),
            }
            for key, params in owned_expert_parameters(self.trainer.shards).items()
        }

    def _meta_payload(self, window) -> Dict:
        t = self.trainer
        return {
            "step": t.step,
            "config": json.dumps(t.config.to_dict(), default=list),
            "placements": [json.dumps(shard.placement.to_lists()) for shard in t.shards],
            "num_experts": [shard.layer.num_experts for shard in t.shards],
            "trainer": t.state_dict(),
            "recorders": {"window": window},
            "adaptive": self.adaptive.state_dict() if self.adaptive else None,
        }

    def _prune(self, keep: int) -> None:
        for old in complete_checkpoints(self.trainer.config.output.out_dir)[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # -- resume ------------------------------------------------------------------------------------
    def resume(self, spec: str) -> Optional[Path]:
        """'' = fresh start; 'auto' = newest complete checkpoint if any; else a checkpoint directory."""
        if not spec:
            return None
        if spec == "auto":
            found = complete_checkpoints(self.trainer.config.output.out_dir)
            if not found:
                return None
            path = found[-1]
        else:
            path = Path(spec)
            if not (path / "meta.pt").is_file():
                raise CheckpointError(f"checkpoint {path} is missing or incomplete (no {path / 'meta.pt'})")
        self.load(path)
        return path

    def load(self, path: Path) -> None:
        t = self.trainer
        meta = load_file(path / "meta.pt")
        self._check_architecture(json.loads(meta["config"]), path)
        dense = dense_directory(path)
        dense_shapes = saved_dense_shapes(read_metadata(dense))  # no communication: before any collective
        saved = [Placement.from_lists(json.loads(p)) for p in meta["placements"]]
        placements = [resume_placement(p, t.groups.ep_size) for p in saved]
        experts = {}
        for owner in owner_files_needed(saved, placements, t.groups.ep_rank):
            experts.update(load_file(path / f"experts_ep{owner}.pt"))
        t.shards = reshard(
            t.shards, placements, dense_shapes, {key: e["params"] for key, e in experts.items()}, t.groups
        )
        shard_experts(t.shards, t.sharding)
        refresh_param_groups(t.optimizer, t.model)
        load_dense(dense, dense_named_parameters(t.model, t.shards), t.optimizer, t.groups)
        self._expert_optimizer_state().load_state_dict({key: e["state"] for key, e in experts.items()})
        t.recorders.load_state_dict(self._window_share(meta["recorders"]))
        if self.adaptive is not None and meta["adaptive"] is not None:
            self.adaptive.load_state_dict(meta["adaptive"])
        t.load_state_dict(meta["trainer"])

    def _window_share(self, saved: Dict) -> Dict:
        """The window's sum over ranks goes to rank 0; the others start from zeros, and the window's end
        sums again."""
        window = saved["window"]
        if window is None or self.trainer.is_rank0:
            return saved
        return {"window": torch.zeros_like(window)}

    def _check_architecture(self, saved: Dict, path: Path) -> None:
        current = json.loads(json.dumps(self.trainer.config.to_dict(), default=list))
        for section in ARCHITECTURE_SECTIONS:
            differing = [k for k in current[section] if current[section][k] != saved.get(section, {}).get(k)]
            if section == "task":
                differing = [k for k in differing if k in ("name", "max_len", "num_samples", "seed", "path")]
            if differing:
                raise CheckpointError(
                    f"checkpoint {path} was written for a different [{section}]: "
                    f"{', '.join(f'{k} {saved[section].get(k)!r} != {current[section][k]!r}' for k in differing)}"
                )
