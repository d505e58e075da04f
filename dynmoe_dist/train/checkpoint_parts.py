"""The two checkpoint parts that keep their bulk in files of their own inside ``step_N/`` (the others live in
meta.pt): the expert set and the dense state. Both follow train/checkpoint.py's ``OwnFiles`` protocol:
``save_files(directory)`` writes (collective) and returns the part's small entry for meta.pt;
``load_files(directory, entry)`` reads it back (collective), resharded to how this run holds it.

  experts_ep{r}.safetensors
                    the experts owned by ep rank r (``Placement.owner``): weights and Adam state by
                    'layer/logical id', written by the ranks of the first dp group one tensor at a time
                    (train/tensor_file.py: no copy of the experts in memory, at most one tensor gathered or
                    on the host); a resuming rank reads only the files whose owners hold experts it will
                    hold. Checkpoints written before hold ``experts_ep{r}.pt`` (torch.save), still read
  dense/            dense parameters (routers included) and their Adam state, a torch.distributed.checkpoint
                    directory (train/dense_state.py): each rank writes its own FSDP shard, DCP reshards
A LoRA run's parts hold only what trains (and the routers): its frozen base is rebuilt from model.path
(train/checkpoint_base.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..moe.experts import expert_key, expert_param_specs
from ..moe.layer import MoELayer, dense_state_tensors
from ..parallel.fsdp import full
from ..parallel.groups import ParallelGroups
from ..parallel.reshard import owner_files_needed
from ..planning.placement import Placement
from .checkpoint_base import FROZEN_BASE, FrozenBase, LayerBase, frozen_names, recipes_from, trained_dense_tensors
from .dense_state import DENSE_DIR, CheckpointError, NamedParams, load_dense, save_dense
from .experts import ExpertPayload, ExpertSet, saved_placements
from .parts import TrainParts
from .tensor_file import read_tensors, write_streamed


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
    return directory / f"experts_ep{ep_rank}.safetensors"


def _flat_name(key: str, kind: str, name: str, field: str = "") -> str:
    """'layer/expert/params/NAME' or 'layer/expert/state/NAME/FIELD' (a parameter name holds no '/')."""
    return "/".join([key, kind, name] + ([field] if field else []))


def flatten_experts(payload: ExpertPayload) -> List[Tuple[str, Tensor]]:
    """An expert payload as (flat name, tensor), in the payload's order (the same on every rank)."""
    flat = []
    for key, entry in payload.items():
        flat += [(_flat_name(key, "params", n), t) for n, t in entry["params"].items()]
        for name, state in entry["state"].items():
            for field, value in state.items():
                if not torch.is_tensor(value):
                    raise TypeError(f"expert {key} {name}: optimizer state {field!r} is not a tensor ({value!r})")
                flat.append((_flat_name(key, "state", name, field), value))
    return flat


def unflatten_experts(flat: Mapping[str, Tensor]) -> ExpertPayload:
    payload: ExpertPayload = {}
    for flat_name, t in flat.items():
        layer, expert, kind, rest = flat_name.split("/", 3)
        entry = payload.setdefault(f"{layer}/{expert}", {"params": {}, "state": {}})
        if kind == "params":
            entry["params"][rest] = t
        else:
            name, field = rest.rsplit("/", 1)
            entry["state"].setdefault(name, {})[field] = t
    return payload


def _to_host(t: Tensor) -> Tensor:
    """A whole tensor on the host: a sharded expert's is gathered (collective), a host one is itself."""
    return full(t).cpu()


def read_expert_file(directory: Path, owner: int) -> ExpertPayload:
    """The experts in ep rank ``owner``'s file of a checkpoint (the older torch.save file where that is
    what the checkpoint holds)."""
    path = expert_file(directory, owner)
    old = path.with_suffix(".pt")
    if not path.is_file() and old.is_file():
        return load_file(old)
    return unflatten_experts(read_tensors(path))


def expert_file_owners(directory: Path) -> List[int]:
    """The ep ranks whose expert files a checkpoint holds."""
    found = {int(p.name.split(".")[0].removeprefix("experts_ep")) for p in directory.glob("experts_ep*.*")}
    return sorted(found)


class ExpertFiles:
    """The expert set as a checkpoint part: its layout (placements, discarded experts) in meta.pt, its
    experts in the owners' files. With ``base`` (a LoRA run: train/checkpoint_base.py) only what trains is
    written, each expert's recipe beside the layout, and a resume rebuilds the frozen weights from ``base``."""

    def __init__(self, experts: ExpertSet, groups: ParallelGroups, base: Optional[FrozenBase] = None):
        self.experts = experts
        self.groups = groups
        self.base = base

    def save_files(self, directory: Path) -> Dict[str, Any]:
        # Experts are written by their owners as logical tensors, streamed: only the ranks that write them
        # copy them to the host, one tensor at a time, and under expert FSDP every rank of the expert-dp
        # group takes part in gathering each (full_tensor is a collective).
        trainable_only = self.base is not None
        writes = self.groups.dp_rank == 0
        if writes or self.experts.sharded:
            path = expert_file(directory, self.groups.ep_rank) if writes else None
            write_streamed(path, flatten_experts(self.experts.owned_tensors(trainable_only)), _to_host)
        return self.experts.layout(trainable_only)

    def load_files(self, directory: Path, entry: Dict[str, Any]) -> None:
        saved = saved_placements(entry)
        placements = self.experts.resume_placements(entry)
        needed = owner_files_needed(saved, placements, self.groups.ep_rank)
        payload: ExpertPayload = {}
        for owner in needed:
            payload.update(read_expert_file(directory, owner))
        if self.base is not None and FROZEN_BASE not in entry:
            raise CheckpointError(
                f"checkpoint {directory} holds a LoRA run's frozen base in full and no expert recipes (written before "
                "LoRA checkpoints named their base): resume it with the version that wrote it"
            )
        if FROZEN_BASE in entry:
            assert self.base is not None, "a checkpoint without the frozen base resumes only with LoRA on"
            entry = with_frozen_base(entry, payload, placements, self.experts.layers, self.groups.ep_rank, self.base)
        self.experts.load_state_dict({**entry, "experts": payload})


def with_frozen_base(
    entry: Dict[str, Any],
    payload: ExpertPayload,
    placements: Sequence[Placement],
    layers: Sequence[MoELayer],
    ep_rank: int,
    base: FrozenBase,
) -> Dict[str, Any]:
    """A LoRA checkpoint's experts entry made whole: the experts this rank will hold (under ``placements``) and
    every discarded expert get their frozen weights rebuilt from their recipes (``payload`` completed in place)."""
    discarded = list(entry["discarded"])
    for index, (layer, placement, recipes) in enumerate(zip(layers, placements, recipes_from(entry))):
        rebuild = LayerBase(index, layer.config, layer.router.weight, base, recipes.formed)
        for expert in placement.experts_on(ep_rank):
            # an expert none of whose parameters trains (LoRA without 'routed_experts') saved nothing
            saved = payload.setdefault(expert_key(index, expert), {"params": {}, "state": {}})
            saved["frozen"] = frozen_names(saved["params"], layer.config)  # stay frozen; an added expert may train
            saved["params"] = rebuild.with_frozen(saved["params"], recipes.experts[expert])
        if discarded[index] is not None:
            assert recipes.discarded is not None, "a remembered discarded expert has a recipe"
            names = [name for name, _ in expert_param_specs(layer.config)]
            kept = {name: t for name, t in zip(names, discarded[index]) if t is not None}
            discarded[index] = list(rebuild.with_frozen(kept, recipes.discarded).values())
    return {**entry, "discarded": discarded}


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


def weight_parts(parts: TrainParts, base: Optional[FrozenBase] = None) -> Dict[str, Any]:
    """The checkpoint parts that hold a run's weights and their optimizer state, by part name: the expert
    set and the dense state (the trainer adds its small Stateful parts beside them). ``base``: a LoRA run's
    base experts (models.source ``base_expert``) and how it stores them; its checkpoints then hold only what trains
    (train/checkpoint_base.py), every weight otherwise."""
    dense = trained_dense_tensors if base is not None else dense_state_tensors
    return {
        "experts": ExpertFiles(parts.experts, parts.groups, base),
        "dense": DenseFiles(lambda: dense(parts.model), parts.optimizer, parts.groups),
    }


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
