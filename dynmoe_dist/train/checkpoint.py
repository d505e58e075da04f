"""Checkpoints keyed by *logical* expert id, so a job resumes on any number of ranks or ep size, before or
after experts were added and removed.

Layout: ``OUT/checkpoints/step_000120/`` with
  meta.pt          step, config, placements, adaptive state, summed partial window statistics, RNG state
  dense.pt         dense parameters (routers included) and their optimizer state, by parameter name
  experts_ep{r}.pt the experts whose first holder is ep rank r: weights and optimizer state, by
                   (layer, logical id); written by the ranks of the first dp group
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

from ..moe.experts import expert_param_specs
from ..moe.layer import MoELayer
from ..parallel.expert_parallel import install_placement, local_expert_ids
from ..parallel.groups import barrier, sum_over_ranks
from ..parallel.migrate import expert_with
from ..planning.placement import Placement
from ..planning.stats import WindowStats
from .optim import refresh_param_groups
from .recorder import attach_recorders

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
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def load_file(path: Path):
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt or not a checkpoint
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {err}") from err


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, trainer):
        self.trainer = trainer

    # -- naming ------------------------------------------------------------------------------------
    def expert_params(self, layer: MoELayer):
        """(logical id, module) of the experts this rank must write: the ones it holds first."""
        ep_rank = self.trainer.groups.ep_rank
        for expert, module in zip(local_expert_ids(layer, self.trainer.groups), layer.experts.experts):
            if layer.placement is None or min(layer.placement.holders(expert)) == ep_rank:
                yield expert, module

    def dense_named(self):
        expert_ids = {id(p) for layer in self.trainer.moe_layers for p in layer.experts.parameters()}
        return [(n, p) for n, p in self.trainer.model.named_parameters() if id(p) not in expert_ids]

    # -- save --------------------------------------------------------------------------------------
    def save(self) -> Optional[Path]:
        t = self.trainer
        root = checkpoint_root(t.config.output.out_dir)
        final = root / f"step_{t.step:06d}"
        tmp = root / f"step_{t.step:06d}.tmp"
        window = self._summed_window()
        if t.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier(t.groups, "checkpoint start")
        if t.is_rank0:
            atomic_save(self._dense_payload(), tmp / "dense.pt")
            atomic_save(self._meta_payload(window), tmp / "meta.pt")
        if t.groups.dp_rank == 0:
            atomic_save(self._expert_payload(), tmp / f"experts_ep{t.groups.ep_rank}.pt")
        barrier(t.groups, "checkpoint written")
        if t.is_rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune(t.config.output.keep_checkpoints)
        barrier(t.groups, "checkpoint committed")
        return final

    def _summed_window(self):
        """Partial window statistics summed over ranks (resume hands the sum to one rank)."""
        recorders = self.trainer.recorders
        if not recorders or recorders[0].window is None:
            return None
        flat = torch.cat([r.window.to_flat() for r in recorders])
        return sum_over_ranks(flat, self.trainer.groups, "checkpoint window statistics all_reduce")

    def _state_of(self, p) -> Dict:
        return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                for k, v in self.trainer.optimizer.state.get(p, {}).items()}

    def _dense_payload(self) -> Dict:
        return {"params": {n: p.detach().cpu().clone() for n, p in self.dense_named()},
                "state": {n: self._state_of(p) for n, p in self.dense_named() if p in self.trainer.optimizer.state}}

    def _expert_payload(self) -> Dict:
        payload = {}
        for index, layer in enumerate(self.trainer.moe_layers):
            for expert, module in self.expert_params(layer):
                payload[f"{index}/{expert}"] = {
                    "params": {n: p.detach().cpu().clone() for n, p in module.named_parameters()},
                    "state": {n: self._state_of(p) for n, p in module.named_parameters()
                              if p in self.trainer.optimizer.state}}
        return payload

    def _meta_payload(self, window) -> Dict:
        t = self.trainer
        adaptive = t.adaptive
        return {"step": t.step, "config": json.dumps(t.config.to_dict(), default=list),
                "placements": [json.dumps(layer.placement.to_lists()) for layer in t.moe_layers],
                "num_experts": [layer.num_experts for layer in t.moe_layers],
                "version": adaptive.version if adaptive else 0,
                "discarded": [d for d in adaptive.discarded] if adaptive else [],
                "window": window, "rng": torch.get_rng_state()}

    def _prune(self, keep: int) -> None:
        for old in complete_checkpoints(self.trainer.config.output.out_dir)[:-max(1, keep)]:
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
        experts = {}
        for file in sorted(path.glob("experts_ep*.pt")):
            experts.update(load_file(file))
        for index, layer in enumerate(t.moe_layers):
            self._restore_layer(index, layer, meta, dense, experts)
        self._restore_dense(dense)
        refresh_param_groups(t.optimizer, t.model)
        self._restore_expert_state(experts)
        t.recorders = attach_recorders(t.moe_layers)
        self._restore_adaptive(meta)
        t.step = int(meta["step"])
        torch.set_rng_state(meta["rng"])

    def _check_architecture(self, saved: Dict, path: Path) -> None:
        current = json.loads(json.dumps(self.trainer.config.to_dict(), default=list))
        for section in ARCHITECTURE_SECTIONS:
            differing = [k for k in current[section] if current[section][k] != saved.get(section, {}).get(k)]
            if section == "task":
                differing = [k for k in differing if k in ("name", "max_len", "num_samples", "seed", "path")]
            if differing:
                raise CheckpointError(f"checkpoint {path} was written for a different [{section}]: "
                                      f"{', '.join(f'{k} {saved[section].get(k)!r} != {current[section][k]!r}' for k in differing)}")

    def _restore_layer(self, index: int, layer: MoELayer, meta, dense, experts) -> None:
        groups = self.trainer.groups
        saved = Placement.from_lists(json.loads(meta["placements"][index]))
        placement = saved if saved.ep_size == groups.ep_size else Placement.default(saved.num_experts, groups.ep_size)
        prefix = self._layer_prefix(layer)
        for name, _ in list(layer.router.named_parameters()):
            setattr(layer.router, name, torch.nn.Parameter(dense["params"][prefix + "router." + name].to(
                layer.router.weight.device)))
        like = layer.router.weight
        modules = []
        for expert in placement.experts_on(groups.ep_rank):
            params = experts[f"{index}/{expert}"]["params"]
            modules.append(expert_with([params[n].to(like.device) for n, _ in expert_param_specs(layer.config)], layer.config))
        layer.experts.set_experts(modules)
        install_placement(layer, placement, groups, f"moe{index}")

    def _layer_prefix(self, layer: MoELayer) -> str:
        for name, module in self.trainer.model.named_modules():
            if module is layer:
                return f"{name}." if name else ""
        raise AssertionError("layer not in model")

    def _restore_dense(self, dense) -> None:
        t = self.trainer
        with torch.no_grad():
            for name, p in self.dense_named():
                p.copy_(dense["params"][name])
                if name in dense["state"]:
                    t.optimizer.state[p] = _to_device(dense["state"][name], p.device)

    def _restore_expert_state(self, experts) -> None:
        t = self.trainer
        for index, layer in enumerate(t.moe_layers):
            for expert, module in zip(local_expert_ids(layer, t.groups), layer.experts.experts):
                saved = experts[f"{index}/{expert}"]["state"]
                for name, p in module.named_parameters():
                    if name in saved:
                        t.optimizer.state[p] = _to_device(saved[name], p.device)

    def _restore_adaptive(self, meta) -> None:
        t = self.trainer
        if t.adaptive is not None:
            t.adaptive.version = int(meta["version"])
            t.adaptive.discarded = list(meta["discarded"]) or [None] * len(t.moe_layers)
        window = meta.get("window")
        if window is None:
            return
        offset = 0
        for recorder, layer in zip(t.recorders, t.moe_layers):
            recorder.start_window()
            size = recorder.window.to_flat().numel()
            if t.is_rank0:  # the sum over ranks lives on one rank; the window's end sums again
                recorder.window = WindowStats.from_flat(window[offset:offset + size], layer.num_experts,
                                                        layer.config.dim)
            offset += size


def _to_device(state: Dict, device) -> Dict:
    return {k: v.to(device) if torch.is_tensor(v) and k != "step" else v for k, v in state.items()}
