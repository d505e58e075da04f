"""What a run's model is, decided once: one object per kind of model source, carrying everything that follows.

``models.build.build_model`` looks at ``[model]`` once and returns one of
  BuiltModel    weights in place when built: the built-in models, MiniLM, a model a benchmark made itself
  UpcycledHF    a dense transformers model (model.path) with model.moe_layers upcycled into MoE layers
  ImportedMoE   a transformers MoE family whose sparse blocks became MoE layers, built on the meta device and
                filled once the experts are placed (each rank reads its share through the one
                ``ImportedCheckpoint`` built here)
The trainer's assembly (train/parts.py), the calibration (train/calibrate.py) and the export (export.py) ask
the source (``place``, ``fill``, ``routings_to_calibrate``, ``save``); nothing outside models/ asks which
kind it is. ``fill`` is handed the sharding's row filler (parallel.fsdp.fill_local): models/ holds no
parallel code.

A transformers source also describes itself for a self-contained training checkpoint: ``base_files`` (what
its content hash covers: the files at model.path a resumed run reads again) and ``save_definition`` (the
config files an export builds the model from, with no weights, when model.path is gone). A LoRA run's
checkpoint leaves its frozen base out (train/checkpoint_base.py): ``base_expert`` gives the frozen weights a
fresh build gives a logical expert, which a resume or an export combines into each expert's own.

Shape legend: none (whole modules and named tensors).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from ..moe.adapters import is_adapter
from ..moe.config import MoEConfig
from ..moe.layer import find_moe_layers

# (MoE layer index, logical ids of the experts this rank holds, their modules in slot order)
HeldExperts = Tuple[int, Sequence[int], Iterable[nn.Module]]
# parallel.fsdp.fill_local: fill a tensor (or this rank's FSDP rows of it) from a reader of rows
FillRows = Callable[[Tensor, Callable[[int, int], Tensor]], None]
# The files that define a transformers model besides its weights (copied into a checkpoint's model/)
DEFINITION_FILES = ("config.json", "generation_config.json")
# parameter name -> tensor of one expert's frozen weights (no adapters), as the base has them
BaseExpert = Dict[str, Tensor]
# export_files.MAX_SHARD_SIZE's forms: bytes, or save_pretrained's text ('5GB')
ShardSize = Union[int, str]
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".gguf")


@dataclass(frozen=True)
class BuiltModel:
    """A model whose weights are there when it is built; nothing to read later, nothing to calibrate."""

    model: nn.Module

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        self.model.to(device, dtype)

    def fill(self, held: Sequence[HeldExperts], device: torch.device, fill_rows: FillRows) -> None:
        """Nothing to fill: the weights were made with the model."""

    def allocate(self, device: torch.device) -> None:
        """Nothing on the meta device."""

    def routings_to_calibrate(self) -> None:
        return None

    def base_files(self) -> List[Path]:
        return []

    def save_definition(self, directory: Path) -> None:
        """A built-in model is defined by the run's config alone."""

    def check_exportable(self) -> None:
        raise ValueError("a built-in model is no transformers model: only model.source = 'hf' runs export")

    def base_expert(self, layer: int, expert: int) -> BaseExpert:
        raise ValueError("a built-in model has no base at model.path to rebuild its experts from (lora needs 'hf')")

    def save(self, out: Path, tokenizer, step: int, base_model: str, max_shard_size: ShardSize) -> Path:
        self.check_exportable()
        return out


@dataclass(frozen=True)
class UpcycledHF:
    """A dense transformers model (model.path: a directory or a .gguf file) with MoE layers upcycled from its
    MLPs. Loaded whole by every rank for training; built empty from a checkpoint's definition for export."""

    model: nn.Module
    """The HFCausalLM wrapper."""
    path: str
    moe: MoEConfig
    blocks: Tuple[int, ...]
    on_meta: bool = False
    """Built from a definition without weights (export): ``allocate`` gives it storage."""
    dense_mlps: Tuple[BaseExpert, ...] = ()
    """Per MoE layer, the dense MLP its experts were copied from (``upcycled_mlps``), kept for ``base_expert``."""

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        self.model.to(device, dtype)

    def fill(self, held: Sequence[HeldExperts], device: torch.device, fill_rows: FillRows) -> None:
        """Nothing to fill: the base's weights were loaded and copied into the experts when built."""

    def allocate(self, device: torch.device) -> None:
        if self.on_meta:
            from .hf.imported import allocate

            allocate(self.model, _hf(self.model), device)

    def routings_to_calibrate(self) -> None:
        return None

    def base_files(self) -> List[Path]:
        return base_files(self.path)

    def save_definition(self, directory: Path) -> None:
        save_definition(self.path, directory)

    def check_exportable(self) -> None:
        from .hf.pretrained import base_model_type

        base_model_type(_hf(self.model))  # a base without remote-code classes fails before any weight is read

    def base_expert(self, layer: int, expert: int) -> BaseExpert:
        """Every expert of an upcycled layer starts as a copy of its dense MLP."""
        return self.dense_mlps[layer]

    def save(self, out: Path, tokenizer, step: int, base_model: str, max_shard_size: ShardSize) -> Path:
        return _save_remote(self, out, tokenizer, step, base_model, max_shard_size)


@dataclass(frozen=True)
class ImportedMoE:
    """A transformers MoE family built on the meta device with MoE blocks in its sparse blocks; ``checkpoint``
    (the one reader of model.path's files, None when built from a checkpoint's definition for export) fills
    each rank's share once the experts are placed and the dense weights sharded."""

    model: nn.Module
    """The HFCausalLM wrapper."""
    path: str
    moe: MoEConfig
    blocks: Tuple[int, ...]
    checkpoint: Any
    """models.hf.imported.ImportedCheckpoint, or None (built for export)."""

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        self.model.to(dtype)  # stays on the meta device: ``fill`` gives it storage once the shares are known

    def fill(self, held: Sequence[HeldExperts], device: torch.device, fill_rows: FillRows) -> None:
        """Give the model storage on ``device`` and read this rank's share: each dense tensor whole or its FSDP
        rows, and every expert it holds by logical id (an expert is small: read whole, cut by ``fill_rows``)."""
        from functools import partial

        from .hf.imported import allocate, dense_tensors

        assert self.checkpoint is not None, "a model built for export is filled from the training checkpoint"
        hf_model = _hf(self.model)
        allocate(self.model, hf_model, device)
        tensors = dict(hf_model.named_parameters()) | dict(hf_model.named_buffers())
        with torch.no_grad():
            for name, _ in dense_tensors(hf_model):
                initial = self.checkpoint.initial(name)  # a converted router's thresholds: not in the files
                if initial is not None:
                    tensors[name].fill_(initial)
                else:
                    fill_rows(tensors[name], partial(self.checkpoint.rows, name))
            for layer, logical_ids, modules in held:
                for expert, module in zip(logical_ids, modules):
                    read = self.checkpoint.expert(layer, expert)
                    for name, p in module.named_parameters():
                        if not is_adapter(name):  # LoRA's are drawn, not read (models.lora.init_adapters)
                            fill_rows(p, partial(_rows, read[name]))

    def allocate(self, device: torch.device) -> None:
        from .hf.imported import allocate

        allocate(self.model, _hf(self.model), device)

    def routings_to_calibrate(self):
        """The checkpoint's own routing of every sparse block when its routers were converted to top-any
        (their thresholds are calibrated against it before the first step); None otherwise."""
        if self.moe.router != "top_any" or self.checkpoint is None:
            return None
        from .hf.imported import native_routings

        return native_routings(self.checkpoint)

    def base_files(self) -> List[Path]:
        return base_files(self.path)

    def save_definition(self, directory: Path) -> None:
        save_definition(self.path, directory)

    def base_expert(self, layer: int, expert: int) -> BaseExpert:
        """Logical expert ``expert`` of MoE layer ``layer`` as the files at model.path hold it."""
        assert self.checkpoint is not None, "a model built for export reads no base"
        return self.checkpoint.expert(layer, expert)

    def check_exportable(self) -> None:
        if self.moe.router != "native":
            from .hf.pretrained import base_model_type

            base_model_type(_hf(self.model))

    def save(self, out: Path, tokenizer, step: int, base_model: str, max_shard_size: ShardSize) -> Path:
        """Its own routing goes back as it came (the stock layout, plain transformers loads it); a conversion
        is written with remote code."""
        if self.moe.router != "native":
            return _save_remote(self, out, tokenizer, step, base_model, max_shard_size)
        from .hf.stock_layout import save_stock

        save_stock(_hf(self.model).eval(), out, max_shard_size)
        tokenizer.save_pretrained(str(out))
        return out


ModelSource = Union[BuiltModel, UpcycledHF, ImportedMoE]


def upcycled_mlps(model: nn.Module) -> Tuple[BaseExpert, ...]:
    """Per MoE layer of a freshly upcycled model, the frozen weights of its experts (each a copy of the dense MLP
    it replaced: expert 0's, cloned, as the model's experts move and change from here on)."""
    return tuple(
        {name: p.detach().clone() for name, p in layer.experts.experts[0].named_parameters() if not is_adapter(name)}
        for _, layer in find_moe_layers(model)
    )


def _hf(model: nn.Module) -> nn.Module:
    return model.transformers_model()  # type: ignore[operator]  # HFCausalLM


def _rows(full: Tensor, start: int, stop: int) -> Tensor:
    return full[start:stop]


def _save_remote(
    source: Union[UpcycledHF, ImportedMoE], out: Path, tokenizer, step: int, base_model: str, max_shard_size: ShardSize
) -> Path:
    """The exported format (remote code, format 3): the model, its MoE options and blocks, the step."""
    from .hf.pretrained import dynmoe_section, save_exported

    hf_model = _hf(source.model)
    section = dynmoe_section(hf_model, source.moe, sorted(source.blocks), step=step, base_model=base_model)
    return save_exported(hf_model.eval(), section, out, tokenizer, max_shard_size)


# -- model.path, seen once ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FixedOptions:
    """What a model at model.path fixes of a run's options before anything is built (config.load_config
    applies it): values the run may not change, defaults it may, and upper bounds, with the reason."""

    reason: str
    fixed: Dict[str, Any]
    defaults: Dict[str, Any]
    at_most: Dict[str, int]
    correction_bias: bool
    """Its native router has a correction bias (moe.balance = 'bias' moves it)."""


def fixed_options(path: str) -> Optional[FixedOptions]:
    """An imported MoE fixes its expert count and MoE blocks and routes its own way unless told otherwise;
    any other model fixes nothing (None). Reads config.json only."""
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        return None  # a GGUF file or a package: dense models only; a missing path fails in the task's check
    found = moe_at(directory)
    if found is None:
        return None
    return FixedOptions(
        reason=f"model.path ({path!r}) is a {found.model_type} with {found.num_experts} experts per layer",
        fixed={"moe.num_experts": found.num_experts, "model.moe_layers": list(found.sparse_layers)},
        defaults={"moe.router": "native"},
        at_most={"moe.calibrate_k": found.num_experts},
        correction_bias=found.correction_bias,
    )


def decided_options(path: str, moe: MoEConfig) -> Dict[str, Any]:
    """'section.key' -> every value an imported MoE's config.json decides of the run (sizes, heads, blocks,
    expert count and kind; ``--print-config`` shows them); {} for any other model. Reads the config only."""
    from .hf.loading import resolve

    directory, gguf_file = resolve(path)
    if gguf_file is not None or moe_at(directory) is None:
        return {}
    from transformers import AutoConfig

    from .hf.families import family_of

    family = family_of(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    layer = family.layer_config(moe)
    return {
        "model.dim": layer.dim,
        "model.num_heads": int(family.config.num_attention_heads),
        "model.num_layers": int(family.config.num_hidden_layers),
        "model.ffn_dim": layer.ffn_dim,  # the experts' hidden size: moe.ffn_dim follows model.ffn_dim
        "model.moe_layers": family.sparse_layers(),
        **{f"moe.{key}": getattr(layer, key) for key in ("num_experts", "max_experts", "min_experts")},
        **{f"moe.{key}": getattr(layer, key) for key in ("expert_kind", "activation", "expert_bias")},
    }


def require_moe(path: str, field: str) -> Dict[str, Any]:
    """``field`` must be a supported transformers MoE directory: its type, experts per layer and top-k; a
    one-line ValueError otherwise."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{field} ({path!r}) has no config.json: expected a save_pretrained MoE checkpoint")
    found = moe_at(directory, field)
    if found is None:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
        raise ValueError(f"{field} ({path!r}) is a {model_type!r} model with no experts: expected an MoE checkpoint")
    return {"model_type": found.model_type, "num_experts": found.num_experts, "top_k": found.top_k}


def moe_at(directory: Path, field: str = "model.path"):
    """models.hf's ImportedMoE summary of the MoE at ``directory`` (None: a dense model), read once per
    process for an unchanged config.json (the config loader and the builder both ask)."""
    config = directory / "config.json"
    stat = config.stat()
    return _moe_at(str(directory.resolve()), stat.st_mtime_ns, stat.st_size, field)


@lru_cache(maxsize=16)
def _moe_at(directory: str, _mtime_ns: int, _size: int, field: str):
    from .hf.families import imported_moe

    return imported_moe(Path(directory), field)


def base_files(path: str) -> List[Path]:
    """The files at model.path a content hash covers: the definition and the weights (a .gguf file is both)."""
    from .hf.loading import resolve

    directory, gguf_file = resolve(path)
    if gguf_file is not None:
        return [directory / gguf_file]
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and (p.name in DEFINITION_FILES or p.name.endswith(WEIGHT_SUFFIXES))
    )


def save_definition(path: str, directory: Path) -> None:
    """The config files of the model at ``path`` into ``directory``, as the base has them (copied verbatim; a
    .gguf base's config as transformers reads it from the header)."""
    from .hf.loading import resolve

    source, gguf_file = resolve(path)
    directory.mkdir(parents=True, exist_ok=True)
    if gguf_file is not None:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(source), gguf_file=gguf_file, local_files_only=True).save_pretrained(directory)
        return
    for name in DEFINITION_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
