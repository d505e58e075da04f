"""Checkpoints keyed by *logical* expert id, so a job resumes on any number of ranks or ep size, before or
after experts were added and removed.

Layout: ``OUT/checkpoints/step_000120/`` with
  meta.pt          config, placements, and the state_dict() of the trainer (step, RNG, data position),
                   the adaptive controller and the recorders (partial window statistics summed over ranks)
  dense.pt         dense parameters (routers included) and their optimizer state, by parameter name
  experts_ep{r}.pt the experts owned by ep rank r (``Placement.owner``): weights and optimizer state, by
                   'layer/logical id'; written by the ranks of the first dp group
The manager only composes: each part exposes ``state_dict()`` / ``load_state_dict()``, and resharding
experts by logical id is ``parallel.reshard``. A resuming rank reads only the expert files it needs.
Atomic: everything goes into ``step_000120.tmp/`` and rank 0 renames it when all ranks are done; the
previous checkpoint stays until then. Files hold only tensors and plain containers and are read with
``torch.load(weights_only=True)``: no arbitrary pickle is ever loaded.
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
    load_dense,
    local_expert_parameters,
    owned_expert_parameters,
    owner_files_needed,
    reshard,
    resume_placement,
)
from ..planning.placement import Placement
from .optim import OptimizerState, refresh_param_groups

STEP_DIR = re.compile(r"^step_(\d+)$")
ARCHITECTURE_SECTIONS = ("task", "model", "moe")


class CheckpointError(ValueError):
    pass


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


def read_checkpoint_dense(checkpoint: Path) -> Dict:
    """Dense parameters by name (routers included)."""
    return load_file(checkpoint / "dense.pt")["params"]


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

    def _optimizer_state(self) -> OptimizerState:
        t = self.trainer
        return OptimizerState(
            t.optimizer,
            dense_named_parameters(t.model, t.shards),
            owned_expert_parameters(t.shards),
            local_expert_parameters(t.shards),
        )

    # -- save --------------------------------------------------------------------------------------
    def save(self) -> Optional[Path]:
        t = self.trainer
        root = checkpoint_root(t.config.output.out_dir)
        final = root / f"step_{t.step:06d}"
        tmp = root / f"step_{t.step:06d}.tmp"
        window = self._summed_window()
        # Only the ranks that write a payload copy its tensors to the host; under FSDP every rank of the
        # group a payload is gathered over builds it too (full_tensor is a collective).
        optimizer = self._optimizer_state()
        writes_dense, writes_experts = t.is_rank0, t.groups.dp_rank == 0
        dense = self._dense_payload(optimizer.dense_state()) if writes_dense or t.sharding.dense else None
        experts = self._expert_payload(optimizer.expert_state()) if writes_experts or t.sharding.experts else None
        if t.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier(t.groups, "checkpoint start")
        if t.is_rank0:
            atomic_save(dense, tmp / "dense.pt")
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

    # NOTE: device-to-host sync: checkpoints copy every tensor to the host (at checkpoint steps only).
    def _dense_payload(self, optimizer_dense: Dict) -> Dict:
        t = self.trainer
        return {
            "params": {n: full(p.detach()).cpu().clone() for n, p in dense_named_parameters(t.model, t.shards)},
            "state": optimizer_dense,
        }

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
        dense = load_file(path / "dense.pt")
        saved = [Placement.from_lists(json.loads(p)) for p in meta["placements"]]
        placements = [resume_placement(p, t.groups.ep_size) for p in saved]
        experts = {}
        for owner in owner_files_needed(saved, placements, t.groups.ep_rank):
            experts.update(load_file(path / f"experts_ep{owner}.pt"))
        t.shards = reshard(
            t.shards, placements, dense["params"], {key: e["params"] for key, e in experts.items()}, t.groups
        )
        shard_experts(t.shards, t.sharding)
        load_dense(dense_named_parameters(t.model, t.shards), dense["params"])
        refresh_param_groups(t.optimizer, t.model)
        self._optimizer_state().load_state_dict(
            {"dense": dense["state"], "experts": {key: e["state"] for key, e in experts.items()}}
        )
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
