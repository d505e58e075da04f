"""Checkpoints composed of named Stateful parts (torchtitan's ``states={...}``), keyed so that a job
resumes on any number of ranks or ep size, before or after experts were added and removed.

``CheckpointManager(config, groups, states)`` is given what it saves and never the trainer. A part either
is ``Stateful`` (``state_dict()`` / ``load_state_dict()``: small, plain; rank 0 writes every such entry
into meta.pt) or has ``OwnFiles`` (``save_files(dir)`` / ``load_files(dir, entry)``: the expert set and
the dense state, train/checkpoint_parts.py). Layout: ``OUT/checkpoints/step_000120/`` with
  meta.pt          format, step, config, and every part's entry under its name
  dense/           the dense state (a torch.distributed.checkpoint directory, one shard file per rank)
  experts_ep{r}.safetensors  the experts owned by ep rank r with their Adam state, by 'layer/logical id'
  model/           a transformers model's config files and tokenizer, what the export builds it from
                   (train/model_files.py; meta.pt names the base it was trained from by content hash)
A LoRA run's dense/ and expert files hold only what trains (and the routers); its frozen base is read again from
model.path, the hash checked, and each expert's from its recipe in meta.pt (train/checkpoint_base.py).
Atomic: everything goes into ``step_000120.tmp/`` and rank 0 renames it when all ranks are done; the
previous checkpoint stays until then. Retention (``output.keep_checkpoints``) deletes only complete
checkpoints older than the newest few, and each by first renaming it to ``step_000100.old/``: a deletion
cut short leaves a directory no reader takes for a checkpoint, removed at the next save.
Files hold only tensors and plain containers and are read with ``torch.load(weights_only=True)``, DCP's
pickled metadata through an allowlist (``SafeReader``): no arbitrary pickle is ever loaded. Older layouts
(one ``dense.pt``; meta.pt without parts) are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple, Union, runtime_checkable

from ..config import DERIVED_MOE_KEYS, SECTIONS, RunConfig, from_dict
from ..parallel.groups import ParallelGroups, barrier
from .checkpoint_parts import atomic_save, dense_directory, expert_file_owners, load_file, read_expert_file
from .dense_state import CheckpointError, read_dense_params

STEP_DIR = re.compile(r"^step_(\d+)$")
RETIRED = ".old"  # a checkpoint being deleted: renamed first, so that it is never half a checkpoint
FORMAT = 2
ARCHITECTURE_SECTIONS = ("task", "model", "moe")
TASK_ARCHITECTURE_KEYS = ("name", "max_len", "num_samples", "seed", "path")

# The order parts load in, and why (parts a run does not have are skipped):
LOAD_ORDER = (
    "model",  # the base at model.path is the one the run was trained from: checked before anything is read
    "experts",  # rebuilds the banks and resizes the routers to the saved expert counts, then refreshes the
    #             optimizer's groups: the dense load below writes into those router parameters and installs
    #             their Adam state, so they must exist (at the saved shapes) and be the optimizer's first
    "dense",  # fills every dense parameter (routers included) and its Adam state, resharded by DCP
    "balance",  # the k budget's averaged slopes and drifts (moe/balance.py; the tensors it moves are dense state)
    "recorders",  # an open window's statistics, sized for the layers' expert counts after "experts"
    "adaptive",  # the plan version
    "trainer",  # step, data position and RNG last: rebuilding experts above draws from the RNG
)
# Parts a checkpoint written before they existed lacks: it loads without them.
OPTIONAL_PARTS = ("model",)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


@runtime_checkable
class OwnFiles(Protocol):
    """A part that keeps its bulk in files of its own inside the checkpoint directory."""

    def save_files(self, directory: Path) -> Dict[str, Any]: ...

    def load_files(self, directory: Path, entry: Dict[str, Any]) -> None: ...


Part = Union[Stateful, OwnFiles]


class CheckpointManager:
    def __init__(self, config: RunConfig, groups: ParallelGroups, states: Mapping[str, Part]):
        unknown = sorted(set(states) - set(LOAD_ORDER))
        assert not unknown, f"checkpoint parts {unknown} have no place in LOAD_ORDER"
        self.config = config
        self.groups = groups
        self.states = {name: states[name] for name in LOAD_ORDER if name in states}
        self.resumed_config: Optional[Dict[str, Any]] = None
        """The config (as a dict) of the run that wrote the checkpoint this run resumed from."""

    @property
    def is_rank0(self) -> bool:
        return self.groups.rank == 0

    # -- save --------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Collective: every rank writes its parts' files, rank 0 the meta; the directory appears whole."""
        root = checkpoint_root(self.config.output.out_dir)
        final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
        if self.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        barrier(self.groups, "checkpoint start")
        # Every rank takes every part in the same order: several are collective (gathers, sums, DCP).
        entries = {
            name: part.save_files(tmp) if isinstance(part, OwnFiles) else part.state_dict()
            for name, part in self.states.items()
        }
        if self.is_rank0:
            atomic_save(self._meta(step, entries), tmp / "meta.pt")
        barrier(self.groups, "checkpoint written")
        if self.is_rank0:
            commit(tmp, final)
            self._prune(self.config.output.keep_checkpoints)
        barrier(self.groups, "checkpoint committed")
        return final

    def _meta(self, step: int, entries: Dict[str, Any]) -> Dict[str, Any]:
        return {"format": FORMAT, "step": step, "config": config_json(self.config), "states": entries}

    def _prune(self, keep: int) -> None:
        """Delete the complete checkpoints older than the newest ``keep`` (the one just committed is the
        newest; one being written is a .tmp and never complete), and what an earlier deletion left."""
        root = checkpoint_root(self.config.output.out_dir)
        for old in complete_checkpoints(self.config.output.out_dir)[: -max(1, keep)]:
            retire(old)
        for leftover in root.glob(f"step_*{RETIRED}"):
            shutil.rmtree(leftover, ignore_errors=True)

    # -- resume ------------------------------------------------------------------------------------
    def resume(self, spec: str) -> Optional[Path]:
        """'' = fresh start; 'auto' = newest complete checkpoint if any; else a checkpoint directory."""
        if not spec:
            return None
        if spec == "auto":
            found = complete_checkpoints(self.config.output.out_dir)
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
        """Every check that needs no communication first (format, architecture, parts), then the parts in
        LOAD_ORDER."""
        meta = read_meta(path)
        # A checkpoint that names its base by content hash resumes from the base wherever it now lives: the
        # "model" part compares the hashes, so model.path itself may differ
        by_content = ("path",) if (meta["states"].get("model") or {}).get("base") else ()
        self.resumed_config = json.loads(meta["config"])
        check_architecture(self.resumed_config, self.config, path, by_content)
        missing = [name for name in self.states if name not in meta["states"] and name not in OPTIONAL_PARTS]
        if missing:
            raise CheckpointError(f"checkpoint {path} holds no {', '.join(missing)} state (meta.pt parts)")
        for name, part in self.states.items():
            if name not in meta["states"]:
                continue
            entry = meta["states"][name]
            if isinstance(part, OwnFiles):
                part.load_files(path, entry)
            else:
                part.load_state_dict(entry)


def retire(checkpoint: Path) -> Path:
    """Take a complete checkpoint out of the readers' sight at once (a rename), then delete it."""
    retired = checkpoint.with_name(checkpoint.name + RETIRED)
    shutil.rmtree(retired, ignore_errors=True)
    checkpoint.rename(retired)
    shutil.rmtree(retired, ignore_errors=True)
    return retired


def commit(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``. A checkpoint of the same step already there (a run resumed from it and
    stopped again at once) is moved aside first, as a rename cannot replace a non-empty directory, and
    deleted once the new one is in place."""
    aside = final.with_name(final.name + RETIRED)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


# -- reading checkpoints outside a run (export, analyses) ---------------------------------------------
def checkpoint_root(out_dir: str) -> Path:
    return Path(out_dir) / "checkpoints"


def complete_checkpoints(out_dir: str) -> List[Path]:
    """Complete checkpoints (renamed from .tmp, meta present), oldest first."""
    root = checkpoint_root(out_dir)
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "meta.pt").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def last_complete_checkpoint(run_dir: Path, option: str = "RUN_DIR") -> Path:
    """The newest complete checkpoint of a run's output directory; a one-line ValueError naming ``option``
    when it holds none."""
    found = complete_checkpoints(str(run_dir))
    if not found:
        raise ValueError(f"{option} ({str(run_dir)!r}) holds no complete checkpoint (output.final_checkpoint)")
    return found[-1]


def checkpoint_or_last(path: Path) -> Path:
    """``path`` itself when it is a checkpoint directory; a run's output directory (or its checkpoints/)
    -> its newest complete checkpoint, as a user finishing a run would point at it."""
    if (path / "meta.pt").is_file() or not path.is_dir():
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    return last_complete_checkpoint(run_dir, "CHECKPOINT") if checkpoint_root(str(run_dir)).is_dir() else path


def config_json(config: RunConfig) -> str:
    return json.dumps(config.to_dict(), default=list)


def read_meta(checkpoint: Path) -> Dict[str, Any]:
    meta = load_file(checkpoint / "meta.pt")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {checkpoint / 'meta.pt'} is in an older format (no checkpoint parts): "
            "resume or export it with the version that wrote it"
        )
    return meta


def read_checkpoint_meta(checkpoint: Path) -> Tuple[Dict[str, Any], RunConfig]:
    """(meta, the run's config) of a checkpoint directory, for readers outside the run (export, analyses)."""
    if not (checkpoint / "meta.pt").is_file():
        raise ValueError(f"CHECKPOINT ({str(checkpoint)!r}) is not a checkpoint directory (no meta.pt)")
    meta = read_meta(checkpoint)
    saved = json.loads(meta["config"])
    # The saved moe section holds the derived dim / ffn_dim, which a run file may not set.
    saved["moe"] = {k: v for k, v in saved.get("moe", {}).items() if k not in DERIVED_MOE_KEYS}
    return meta, from_dict(saved)


def saved_expert_counts(meta: Dict[str, Any]) -> List[int]:
    """Experts per MoE layer at the checkpoint's step."""
    return [int(n) for n in meta["states"]["experts"]["num_experts"]]


def read_checkpoint_dense(checkpoint: Path) -> Dict:
    """Dense parameters by name (routers included), as full tensors on this one process."""
    return read_dense_params(dense_directory(checkpoint))


def read_checkpoint_experts(checkpoint: Path) -> Dict[str, Dict]:
    """Experts by 'layer/logical id' (params and optimizer state), whatever the world size: every expert
    file is read, and a replicated expert was saved once."""
    experts: Dict[str, Dict] = {}
    for owner in expert_file_owners(checkpoint):
        experts.update(read_expert_file(checkpoint, owner))
    return experts


def _unwritten(section: str, key: str) -> Any:
    """What a checkpoint written before option ``section.key`` existed ran with: its declared default (a
    run that leaves it there resumes such a checkpoint; one that sets it is told the value differs)."""
    field = next((f for f in dataclasses.fields(SECTIONS[section]) if f.name == key), None)
    return None if field is None or field.default is dataclasses.MISSING else field.default


def check_architecture(saved: Dict, config: RunConfig, path: Path, model_by_content: Tuple[str, ...] = ()) -> None:
    """The sections that decide the model's shape must match the run's (the task's data-defining keys; of
    [model], not the keys in ``model_by_content``, which a content hash checks instead)."""
    current = json.loads(config_json(config))
    for section in ARCHITECTURE_SECTIONS:
        written = saved.get(section, {})
        differing = [k for k in current[section] if current[section][k] != written.get(k, _unwritten(section, k))]
        if section == "task":
            differing = [k for k in differing if k in TASK_ARCHITECTURE_KEYS]
        if section == "model":
            differing = [k for k in differing if k not in model_by_content]
        if differing:
            raise CheckpointError(
                f"checkpoint {path} was written for a different [{section}]: "
                f"{', '.join(f'{k} {saved[section].get(k)!r} != {current[section][k]!r}' for k in differing)}"
            )
