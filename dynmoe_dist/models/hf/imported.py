"""An imported transformers MoE (model.path a directory of a family in models/hf/families/)
built WITHOUT its weights, and the checkpoint those weights come from.

A checkpoint may be too large for one rank. So the model is built on the meta device (buffers, e.g. the
rotary frequencies, stay real), its sparse blocks are replaced by MoE blocks (``import_moe``), and every
tensor the model will need is checked against the files' headers (shape and presence) before anything
else happens. After expert parallelism and FSDP decided what a rank holds, the trainer fills it from an
``ImportedCheckpoint``: each dense tensor whole or only its FSDP rows, each expert the rank holds from its
slice of the files (safetensors ``get_slice``): no rank ever loads the whole model.

Keys: the model's own names are the checkpoint's, except each MoE block's router (``P.moe.router.weight``
-> ``P.gate.weight``, Mixtral's ``block_sparse_moe``) and its experts (read by logical id through
the family adapter's read_expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from ...moe.adapters import is_adapter
from ...moe.config import MoEConfig
from ...moe.layer import SoftmaxRouter, TopAnyRouter, dense_state_tensors
from ...moe.routing import NativeRule
from .families import MoEFamily, family_of, new_causal_lm, sparse_block_prefixes
from .moe_import import import_moe
from .safetensors_reader import CheckpointReader


def build_on_meta(directory: Path, moe: MoEConfig) -> nn.Module:
    """The transformers model of ``directory``'s config with MoE blocks in place of its sparse blocks, every
    parameter on the meta device (no weights read), in training mode, tied weights tied."""
    hf = build_empty(directory)
    # The MoE blocks straight on the meta device: under init_empty_weights every expert would first be
    # created and randomly initialised on the CPU (seconds for a large model, on every rank)
    with torch.device("meta"):
        import_moe(hf, moe)
    return hf.train()


def build_empty(directory: Path, gguf_file: Optional[str] = None) -> nn.Module:
    """The transformers causal LM of ``directory``'s config (or a .gguf file's header), every parameter on
    the meta device, buffers real (the rotary frequencies are computed from the config), tied weights tied,
    in training mode."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True, **extra)
    with init_empty_weights(include_buffers=False):
        hf = new_causal_lm(config, dtype=torch.float32)
    # Tied outside the context: inside, accelerate wraps every parameter set on a module anew (untying it)
    hf.tie_weights()
    if gguf_file is None and (directory / "generation_config.json").is_file():  # as from_pretrained reads it
        from transformers import GenerationConfig

        hf.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    return hf.train()


class ImportedCheckpoint:
    """The safetensors files of an imported MoE, read by the model's own parameter names and by logical
    expert; only the requested bytes are read."""

    def __init__(self, directory: Path, hf_model: nn.Module):
        self.reader = CheckpointReader(directory)
        self.family: MoEFamily = family_of(hf_model)
        self.prefixes: List[str] = sparse_block_prefixes(hf_model)
        # a vision-language model's files name the text model under a prefix of their own
        ours, theirs = self.family.wrapped_prefix
        wrapped = bool(theirs) and any(key.startswith(theirs) for key in self.reader.files)
        self.renamed = (ours, theirs) if wrapped else None
        self.router_keys: Dict[str, str] = {
            f"{prefix}.moe.router.{name}": key
            for prefix in self.prefixes
            for name, key in self.family.checkpoint_router_keys(self.stored(prefix)).items()
        }
        # A router converted to top-any has thresholds the checkpoint never had: they start at
        # moe.threshold_init (and a calibration may set them), they are not read.
        self.new_tensors: Dict[str, float] = {
            f"{prefix}.moe.router.threshold": float(router.config.threshold_init)
            for prefix in self.prefixes
            if isinstance(router := hf_model.get_submodule(f"{prefix}.moe.router"), TopAnyRouter)
        }
        # So has a converted top-k router's choice bias (moe.balance = 'bias'): it starts at 0 and moves by
        # the balance rule only.
        self.new_tensors.update(
            {
                f"{prefix}.moe.router.choice_bias": 0.0
                for prefix in self.prefixes
                if isinstance(router := hf_model.get_submodule(f"{prefix}.moe.router"), SoftmaxRouter)
                and router.choice_bias is not None
            }
        )

    def stored(self, name: str) -> str:
        """``name`` (a key or a block prefix of the model) as the files name it."""
        if self.renamed is None or not name.startswith(self.renamed[0]):
            return name
        return self.renamed[1] + name[len(self.renamed[0]) :]

    def key(self, name: str) -> str:
        """The checkpoint's key of the model's parameter or buffer ``name``."""
        return self.router_keys.get(name) or self.stored(name)

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        return self.reader.rows(self.key(name), start, stop)

    def initial(self, name: str) -> Optional[float]:
        """The value a tensor the checkpoint does not hold starts with (None: it is read)."""
        return self.new_tensors.get(name)

    def expert(self, layer: int, expert: int) -> Dict[str, Tensor]:
        """Logical expert ``expert`` of MoE layer ``layer`` (the i-th sparse block): parameter name -> tensor."""
        return self.family.read_expert(self.reader, self.stored(self.prefixes[layer]), expert)

    def check(self, hf_model: nn.Module) -> None:
        """Every tensor the model needs is in the files with the model's shape (headers only): a one-line
        ValueError naming the file and the key otherwise."""
        for prefix in self.prefixes:
            self.family.check_block_shapes(self.reader, self.stored(prefix))
        for name, want in dense_tensors(hf_model):
            if name in self.new_tensors:
                continue
            key = self.key(name)
            have = self.reader.shape(key)  # ValueError naming the directory for a missing key
            if tuple(have) != tuple(want):
                raise ValueError(f"{self.reader.file_of(key)}: {key} has shape {tuple(have)}, the model's is {want}")


def dense_tensors(hf_model: nn.Module) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of what is read by name: the model's dense state (moe.layer.dense_state_tensors) but LoRA's
    adapters, which models.lora.init_adapters draws."""
    return [(name, tuple(t.shape)) for name, t in dense_state_tensors(hf_model) if not is_adapter(name)]


def open_imported(directory: Path, hf_model: nn.Module) -> ImportedCheckpoint:
    checkpoint = ImportedCheckpoint(directory, hf_model)
    checkpoint.check(hf_model)
    return checkpoint


def allocate(model: nn.Module, hf_model: nn.Module, device: torch.device) -> None:
    """Give every meta tensor of ``model`` (which holds ``hf_model``) uninitialised storage on ``device``:
    the buffers built for real (the rotary frequencies, computed from the config) keep their values, tied
    weights stay tied. The caller fills the parameters (a checkpoint, a training checkpoint)."""
    kept = {name: b.detach().clone() for name, b in hf_model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in hf_model.named_buffers():
            if name in kept:
                b.copy_(kept[name])
    cast(Any, hf_model).tie_weights()


@dataclass(frozen=True)
class NativeRouting:
    """One sparse block's routing as the checkpoint has it: the family's rule and the router's tensors (the
    weight, gpt-oss's bias, DeepSeek-V3's correction bias). A router converted to top-any keeps only the
    weight's rows; calibrating its thresholds needs the rest."""

    rule: NativeRule
    weight: Tensor
    bias: Optional[Tensor]
    correction: Optional[Tensor]


def native_routings(checkpoint: ImportedCheckpoint) -> List[NativeRouting]:
    """The checkpoint's routing of every sparse block, in order (router tensors read whole: they are small)."""
    rule = checkpoint.family.rule()
    routings = []
    for prefix in checkpoint.prefixes:
        tensors = checkpoint.family.read_router(checkpoint.reader, checkpoint.stored(prefix))
        routings.append(
            NativeRouting(rule, tensors["weight"], tensors.get("bias"), tensors.get("e_score_correction_bias"))
        )
    return routings


def stock_tensor_specs(model: nn.Module) -> List[Tuple[str, Tuple[int, ...]]]:
    """(key, shape) of every tensor save_pretrained writes for the stock transformers MoE ``model`` of a
    family with gated experts without bias (Qwen3-MoE's), in the model's order: its in-memory state with
    each sparse block's fused expert tensors replaced by the per-expert keys of the files. ``model`` may sit
    on the meta device."""
    family = family_of(model)
    d, f = int(family.config.hidden_size), family.ffn_dim()
    expert_shapes = {"w_gate": (f, d), "w_in": (f, d), "w_out": (d, f)}
    fused = {f"{prefix}.{key}": prefix for prefix in sparse_block_prefixes(model) for key in family.fused_keys()}
    specs: List[Tuple[str, Tuple[int, ...]]] = []
    expanded = set()
    for key, t in model.state_dict().items():
        prefix = fused.get(key)
        if prefix is None:
            specs.append((key, tuple(t.shape)))
        elif prefix not in expanded:  # a block's fused tensors become its experts' keys, once
            expanded.add(prefix)
            for expert in range(family.num_experts()):
                keys = family.checkpoint_expert_keys(prefix, expert)
                specs += [(keys[name], expert_shapes[name]) for name in ("w_gate", "w_in", "w_out")]
    return specs
