"""The dense half of a checkpoint: every parameter that is not an expert's (routers included) and its Adam
state, as one ``torch.distributed.checkpoint`` (DCP) directory, ``step_N/dense/``.

Keys: ``param/<name>`` and ``adam/<name>/<key>`` (exp_avg, exp_avg_sq, step). Tensors go to DCP as the run
holds them: DTensor shards under ``dense_sharding = "fsdp"`` (each rank writes its own shard, nothing is
gathered), plain tensors when replicated (DCP writes a replicated tensor once). One code path for both:
DCP reshards on load, between world sizes and between replicate and fsdp, into whatever the resuming run
holds. Loading writes in place into the live parameters and into zero Adam moments shaped like them.

DCP's ``.metadata`` file is a pickle. ``SafeReader`` unpickles it with an allowlist of DCP's metadata
classes and refuses byte (pickled object) entries, whose loader would run ``torch.load(weights_only=False)``;
tensor data DCP already reads with ``weights_only=True``. A checkpoint therefore never runs arbitrary code.
"""

from __future__ import annotations

import contextlib
import enum
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ..parallel.groups import CollectiveError, ParallelGroups, named

DENSE_DIR = "dense"
PARAM, ADAM = "param/", "adam/"
METADATA_FILE = ".metadata"
NamedParams = Sequence[Tuple[str, torch.Tensor]]
"""(name, tensor) of the dense state: parameters (with their Adam state) and the routers' saved buffers."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, unsafe or does not fit the run; the message names the file."""


# -- safe metadata -----------------------------------------------------------------------------------
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps the name 'torch.strided' back to the layout
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _metadata_enum_member(cls: Any, name: str) -> Any:
    """What ``builtins.getattr`` may do while the metadata is read: Python before 3.11.5 (Debian 12's 3.11.2, say)
    pickles an Enum member as ``getattr(its class, its name)``; only a member of an allowed Enum is given."""
    allowed = isinstance(cls, type) and cls.__name__ in _METADATA_CLASSES.get(cls.__module__, ())
    if allowed and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not a member of a checkpoint metadata enum")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _metadata_enum_member
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata class")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata unpickling is restricted to DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except FileNotFoundError as err:
            raise CheckpointError(f"checkpoint file {path} does not exist") from err
        except Exception as err:  # refused class, truncated or not a pickle
            raise CheckpointError(f"checkpoint file {path} is corrupt or unsafe: {err}") from err
        _check_metadata(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_metadata(metadata: Any, path: Path) -> None:
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint file {path}: entry {key!r} is not a tensor (pickled objects refused)")
    for info in (metadata.storage_data or {}).values():
        relative = str(info.relative_path)
        if Path(relative).name != relative:  # data files sit beside .metadata, nowhere else
            raise CheckpointError(f"checkpoint file {path}: data file {relative!r} is outside the checkpoint")


def read_metadata(directory: Path) -> Metadata:
    """The dense directory's metadata (no communication; every rank reads it itself)."""
    return SafeReader(directory).read_metadata()


@contextlib.contextmanager
def _quiet_if_single(no_dist: bool) -> Iterator[None]:
    """DCP warns on every single-process save and load; one process is the intended case here."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# -- save ----------------------------------------------------------------------------------------------
def dense_state_dict(params: NamedParams, optimizer: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """What DCP writes: parameters and Adam state as the run holds them (shards stay shards)."""
    state: Dict[str, torch.Tensor] = {PARAM + name: p.detach() for name, p in params}
    for name, p in params:
        for key, value in optimizer.state.get(p, {}).items():
            assert torch.is_tensor(value), f"optimizer state {name}/{key} is not a tensor"
            state[f"{ADAM}{name}/{key}"] = value.detach()
    return state


def save_dense(directory: Path, params: NamedParams, optimizer: torch.optim.Optimizer, groups: ParallelGroups) -> None:
    """Collective: every rank writes its shards into `directory` (rank 0 also writes .metadata)."""
    # NOTE: device-to-host sync: DCP copies each tensor to the host as it writes it (checkpoint steps only).
    no_dist = not groups.distributed
    what = "checkpoint dense state save (torch.distributed.checkpoint)"
    try:
        with named(what, groups), _quiet_if_single(no_dist):
            dcp.save(
                dense_state_dict(params, optimizer),
                storage_writer=FileSystemWriter(directory, single_file_per_rank=True, sync_files=True),
                no_dist=no_dist,
            )
    except CheckpointException as err:  # a BaseException: a write failed on some rank (disk full...)
        raise CollectiveError(f"{what} into {directory} failed: {summary(err)}") from err


# -- load ----------------------------------------------------------------------------------------------
def saved_shapes(metadata: Metadata) -> Dict[str, torch.Size]:
    """Parameter name -> saved (full) shape."""
    return {
        key[len(PARAM) :]: entry.size
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(PARAM) and isinstance(entry, TensorStorageMetadata)
    }


def _load_targets(params: NamedParams, metadata: Metadata, directory: Path) -> Tuple[Dict, Dict]:
    """(DCP load targets, per-parameter Adam state to install). Parameters load in place; Adam state
    goes into zeros shaped like its parameter (a DTensor shard under FSDP), ``step`` into a host scalar
    (Adam keeps it there)."""
    entries = metadata.state_dict_metadata
    shapes = saved_shapes(metadata)
    targets: Dict[str, torch.Tensor] = {}
    adam: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
    for name, p in params:
        if name not in shapes:
            raise CheckpointError(f"{directory}: no saved weights for parameter {name}")
        if tuple(shapes[name]) != tuple(p.shape):
            saved = tuple(shapes[name])
            raise CheckpointError(f"{directory}: {name} was saved {saved}, the model's is {tuple(p.shape)}")
        targets[PARAM + name] = p.detach()
        prefix = f"{ADAM}{name}/"
        # A parameter frozen in this run keeps no Adam state (the optimizer does not hold it).
        for key in [k for k in entries if k.startswith(prefix)] if p.requires_grad else []:
            entry = entries[key]
            assert isinstance(entry, TensorStorageMetadata)
            sub = key[len(prefix) :]
            value = (
                torch.zeros(entry.size, dtype=entry.properties.dtype) if sub == "step" else torch.zeros_like(p.detach())
            )
            targets[key] = adam.setdefault(p, {})[sub] = value
    return targets, adam


def load_dense(directory: Path, params: NamedParams, optimizer: torch.optim.Optimizer, groups: ParallelGroups) -> None:
    """Collective: fill the dense parameters and their Adam state from `directory`, resharded to how this
    run holds them. The shapes must already match (routers resized to the saved expert counts)."""
    metadata = read_metadata(directory)  # checked on every rank before the collective load
    targets, adam = _load_targets(params, metadata, directory)
    _load(targets, directory, no_dist=not groups.distributed)
    for p, state in adam.items():
        optimizer.state[p] = dict(sorted(state.items(), key=lambda kv: kv[0] != "step"))


def _load(targets: Dict[str, torch.Tensor], directory: Path, no_dist: bool) -> None:
    """dcp.load, whose failures (a data file missing or truncated on some rank; DCP gathers every rank's
    error, and the default group's timeout bounds the wait) name the directory."""
    try:
        with _quiet_if_single(no_dist):
            dcp.load(targets, storage_reader=SafeReader(directory), no_dist=no_dist)
    except CheckpointException as err:  # a BaseException: DCP's gathered per-rank failures
        ours = [e for e, _ in err.failures.values() if isinstance(e, CheckpointError)]
        if ours:
            raise ours[0] from err
        raise CheckpointError(f"checkpoint directory {directory} is corrupt or unreadable: {summary(err)}") from err
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"checkpoint directory {directory} is corrupt or unreadable: {err}") from err


def summary(err: CheckpointException) -> str:
    """One line for DCP's multi-line, per-rank report."""
    return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(err.failures.items()))


def read_dense_params(directory: Path) -> Dict[str, torch.Tensor]:
    """Every dense parameter as a full tensor on this process, without a process group (export, analyses:
    one process that may hold the whole model)."""
    metadata = read_metadata(directory)
    targets = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(PARAM) and isinstance(entry, TensorStorageMetadata)
    }
    _load(targets, directory, no_dist=True)
    return {key[len(PARAM) :]: value for key, value in targets.items()}


def dense_files(directory: Path) -> List[Path]:
    """The DCP data files (one per writing rank), for tests and the benchmark."""
    return sorted(directory.glob("*.distcp"))
