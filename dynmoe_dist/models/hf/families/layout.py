"""Where a family's experts and routers live, in transformers' memory and in its checkpoint files, and the
moves between those layouts and ours: the half of a family adapter that is about keys (torchtitan's
state_dict_adapter idea). Plain tensors and safetensors headers: no model, no parallel code.

Shape legend: E experts, D model dim (hidden_size), F expert hidden dim.

An expert lives in three layouts. Ours: one module per logical expert (``moe.experts``), nn.Linear layout,
under ``P.moe.experts.experts.{e}.w_gate / w_in / w_out`` (+ b_gate / b_in / b_out) for the sparse block at
prefix P (``model.layers.3.mlp``). transformers 5 in memory ("fused"): P.experts.gate_up_proj[e] (2F, D),
gate rows 0:F, up rows F:2F, and P.experts.down_proj[e] (D, F) for most families (gpt-oss interleaves and
transposes: its module says so). The checkpoint files ("checkpoint": what save_pretrained writes and the hub
holds): transformers fuses the per-expert tensors on load and splits them again on save (its
conversion_mapping.py), so most families' files keep ``P.experts.{e}.gate_proj / up_proj / down_proj.weight``
(Mixtral's ``...block_sparse_moe.experts.{e}.w1 / w3 / w2.weight``); a family without such a mapping keeps
the fused tensors (``checkpoint_experts`` None). Every key that is not an expert or a router maps to itself.

Reading: ``read_expert`` reads one logical expert from a ``CheckpointReader``, only its bytes, whichever
layout the files hold. Writing: ``to_checkpoint_layout`` gives the keys save_pretrained writes.
``to_fused_layout`` / ``from_fused_layout`` map our state (or gradients) onto transformers' in-memory
parameters and back: what the tests compare against transformers' own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..safetensors_reader import CheckpointReader

Index = Tuple[Union[int, slice], ...]


@dataclass(frozen=True)
class ExpertSlice:
    """Where one expert parameter lives in a block's fused tensor: ``fused[(e, *index)]``, transposed when
    ``transpose`` (the checkpoint stores (in, out), the expert nn.Linear's (out, in))."""

    key: str
    """The fused tensor's key relative to the block (``experts.gate_up_proj``)."""
    index: Index
    """The expert's part of ``fused[e]`` (a half of gate_up, every other column of gpt-oss's)."""
    transpose: bool = False

    def full_index(self, expert: int) -> Index:
        return (expert, *self.index)

    def take(self, fused: Tensor, expert: int) -> Tensor:
        """The parameter of ``expert`` from the whole fused tensor (a view)."""
        part = fused[self.full_index(expert)]
        return part.t() if self.transpose else part

    def put(self, fused: Tensor, expert: int, value: Tensor) -> None:
        """Write ``value`` (the expert's parameter) into position ``expert`` of ``fused``: take's inverse."""
        fused[self.full_index(expert)] = value.t() if self.transpose else value


@dataclass(frozen=True)
class ExpertSource:
    """One expert parameter in a checkpoint: ``stored[index]`` of ``key`` (``()``: the whole tensor),
    transposed when ``transpose``."""

    key: str
    index: Index = ()
    transpose: bool = False

    def read(self, reader: CheckpointReader) -> Tensor:
        """The parameter (nn.Linear layout, contiguous), reading only this slice of the file."""
        part = reader.slice(self.key, self.index) if self.index else reader.tensor(self.key)
        return (part.t() if self.transpose else part).contiguous()


def expert_key(prefix: str, slot: int, name: str) -> str:
    """Our state-dict key of parameter ``name`` of the expert in bank position ``slot`` of block ``prefix``."""
    return f"{prefix}.moe.experts.experts.{slot}.{name}"


def _others(state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
    ours = tuple(f"{prefix}.moe." for prefix in prefixes)
    return {key: value for key, value in state.items() if not key.startswith(ours)}


class FamilyLayout:
    """A family's keys: the fused tensors in memory (gate and up as halves, the default), its router's
    tensors, the per-expert keys of its files; and reading / writing them. Subclasses (the family modules)
    change the class variables, or the layout methods for a layout of their own."""

    num_experts_key: ClassVar[str]
    """The config field holding the expert count (written back when experts were removed)."""
    ffn_key: ClassVar[str] = "moe_intermediate_size"
    router_keys_in_block: ClassVar[Dict[str, str]] = {"weight": "gate.weight"}
    """Native router tensor name -> its key relative to the block (DeepSeek adds the correction bias)."""
    checkpoint_block: ClassVar[str] = "mlp"
    """The sparse block's name in the checkpoint files (Mixtral's is block_sparse_moe)."""
    checkpoint_experts: ClassVar[Optional[Dict[str, str]]] = {
        "w_gate": "gate_proj",
        "w_in": "up_proj",
        "w_out": "down_proj",
    }
    """Expert parameter -> its module in the checkpoint's per-expert keys; None: the files keep the fused
    tensors (gpt-oss)."""

    def __init__(self, config: Any):
        self.config = config

    def num_experts(self) -> int:
        return int(getattr(self.config, self.num_experts_key))

    def ffn_dim(self) -> int:
        return int(getattr(self.config, self.ffn_key))

    def with_num_experts(self, config: Any, num_experts: int) -> None:
        """Set the expert count of ``config`` (a copy being written back) to ``num_experts``."""
        setattr(config, self.num_experts_key, num_experts)

    # -- the layouts --------------------------------------------------------------------------------------
    def expert_layout(self) -> Dict[str, ExpertSlice]:
        """Expert parameter name -> where it lives in the block's fused tensors: gate_up_proj (E, 2F, D) =
        [gate; up], down_proj (E, D, F), already nn.Linear's (out, in)."""
        f = self.ffn_dim()
        return {
            "w_gate": ExpertSlice("experts.gate_up_proj", (slice(0, f),)),
            "w_in": ExpertSlice("experts.gate_up_proj", (slice(f, 2 * f),)),
            "w_out": ExpertSlice("experts.down_proj", ()),
        }

    def fused_shapes(self, num_experts: int) -> Dict[str, Tuple[int, ...]]:
        """Fused tensor key (relative to the block) -> its shape for ``num_experts`` experts."""
        d, f = int(self.config.hidden_size), self.ffn_dim()
        return {"experts.gate_up_proj": (num_experts, 2 * f, d), "experts.down_proj": (num_experts, d, f)}

    def fused_keys(self) -> List[str]:
        return list(self.fused_shapes(0))

    def gate_up_rows(self) -> Tensor:
        """For each output feature of the fused gate_up_proj, the row of an expert's input side it holds (w_gate's
        rows 0..F then w_in's F..2F, the order of its adapter's B): how that adapter is laid out on the fused
        tensor (PEFT's target_parameters). Read off ``expert_layout`` by placing the row numbers themselves."""
        f, layout = self.ffn_dim(), self.expert_layout()
        gate, up = layout["w_gate"], layout["w_in"]
        fused = torch.zeros(self.fused_shapes(1)[gate.key], dtype=torch.long)
        for s, first in ((gate, 0), (up, f)):
            s.put(fused, 0, torch.arange(first, first + f).unsqueeze(1).expand_as(s.take(fused, 0)))
        out_by_in = fused[0].t() if gate.transpose else fused[0]  # nn.Linear's (out, in)
        return out_by_in[:, 0].clone()

    def router_keys(self) -> Dict[str, str]:
        """Native router tensor name -> its key relative to the block."""
        return dict(self.router_keys_in_block)

    def checkpoint_prefix(self, prefix: str) -> str:
        """The block's prefix in the checkpoint files (``...layers.3.block_sparse_moe`` for Mixtral)."""
        head, _, _ = prefix.rpartition(".")
        return f"{head}.{self.checkpoint_block}" if head else self.checkpoint_block

    def checkpoint_router_keys(self, prefix: str) -> Dict[str, str]:
        """Native router tensor name -> its full key in the checkpoint files."""
        block = self.checkpoint_prefix(prefix)
        return {name: f"{block}.{key}" for name, key in self.router_keys().items()}

    def checkpoint_expert_keys(self, prefix: str, expert: int) -> Dict[str, str]:
        """Expert parameter -> its full per-expert key in the checkpoint files (families that split them)."""
        assert self.checkpoint_experts is not None, f"{type(self).__name__} checkpoints keep the fused tensors"
        block = self.checkpoint_prefix(prefix)
        return {name: f"{block}.experts.{expert}.{module}.weight" for name, module in self.checkpoint_experts.items()}

    # -- fused tensors <-> experts ------------------------------------------------------------------------
    def expert_tensors(self, fused: Mapping[str, Tensor], expert: int) -> Dict[str, Tensor]:
        """Expert ``expert``'s parameters (views) from a block's fused tensors (key relative to the block)."""
        return {name: s.take(fused[s.key], expert) for name, s in self.expert_layout().items()}

    def fuse_experts(self, experts: Sequence[Mapping[str, Tensor]]) -> Dict[str, Tensor]:
        """The block's fused tensors (key relative to the block) holding ``experts`` in that order: the stock
        layout of a block whose experts were removed or reordered. expert_tensors' inverse."""
        like = experts[0]["w_in"]
        fused = {key: like.new_empty(shape) for key, shape in self.fused_shapes(len(experts)).items()}
        layout = self.expert_layout()
        with torch.no_grad():
            for position, params in enumerate(experts):
                for name, s in layout.items():
                    s.put(fused[s.key], position, params[name].detach())
        return fused

    # -- reading a checkpoint directory ------------------------------------------------------------------
    def expert_sources(self, prefix: str, expert: int, fused: bool) -> Dict[str, ExpertSource]:
        """Parameter name -> where logical expert ``expert`` of the block at ``prefix`` keeps it: in fused
        tensors (``fused``: transformers' in-memory keys, gpt-oss's files) or in per-expert checkpoint keys."""
        if fused or self.checkpoint_experts is None:
            return {
                name: ExpertSource(f"{prefix}.{s.key}", s.full_index(expert), s.transpose)
                for name, s in self.expert_layout().items()
            }
        return {name: ExpertSource(key) for name, key in self.checkpoint_expert_keys(prefix, expert).items()}

    def holds_fused(self, reader: CheckpointReader, prefix: str) -> bool:
        """Whether the files keep the block's experts fused (gpt-oss; a state_dict saved as it is) rather
        than one key per expert (what save_pretrained writes for most families)."""
        return f"{prefix}.{self.fused_keys()[0]}" in reader.files

    def _expert_shapes(self) -> Dict[str, tuple]:
        d, f = int(self.config.hidden_size), self.ffn_dim()
        return {"w_gate": (f, d), "w_in": (f, d), "w_out": (d, f), "b_gate": (f,), "b_in": (f,), "b_out": (d,)}

    def check_expert_shapes(self, reader: CheckpointReader, prefix: str, expert: int) -> None:
        """ValueError naming the file and key when a stored tensor of this expert (a fused tensor: all
        experts) disagrees with the config."""
        if self.holds_fused(reader, prefix):
            wanted = {f"{prefix}.{key}": want for key, want in self.fused_shapes(self.num_experts()).items()}
        else:
            shapes = self._expert_shapes()
            wanted = {key: shapes[name] for name, key in self.checkpoint_expert_keys(prefix, expert).items()}
        for key, want in wanted.items():
            have = reader.shape(key)
            if have != want:
                raise ValueError(
                    f"{reader.file_of(key)}: {key} has shape {have}, but the config ({self.num_experts_key} "
                    f"{self.num_experts()}, hidden_size {self.config.hidden_size}, {self.ffn_key} {self.ffn_dim()}) "
                    f"gives {want}"
                )

    def check_block_shapes(self, reader: CheckpointReader, prefix: str) -> None:
        """Every expert of the block as the config says (headers only: no tensor data is read)."""
        for expert in range(self.num_experts()):
            self.check_expert_shapes(reader, prefix, expert)

    def read_expert(self, reader: CheckpointReader, prefix: str, expert: int) -> Dict[str, Tensor]:
        """Logical expert ``expert`` of the block at ``prefix``: parameter name -> tensor, reading only its
        slices."""
        self.check_expert_shapes(reader, prefix, expert)
        sources = self.expert_sources(prefix, expert, self.holds_fused(reader, prefix))
        return {name: source.read(reader) for name, source in sources.items()}

    def read_router(self, reader: CheckpointReader, prefix: str) -> Dict[str, Tensor]:
        """The block's native router tensors by name (weight, bias, e_score_correction_bias), read whole:
        they are small and every rank routes over all experts."""
        return {name: reader.tensor(key) for name, key in self.checkpoint_router_keys(prefix).items()}

    # -- our state in transformers' layouts ----------------------------------------------------------------
    def experts_of(self, state: Mapping[str, Tensor], prefix: str) -> List[Dict[str, Tensor]]:
        """The block's experts in bank order (keys numbered 0..), parameter name -> tensor."""
        experts: List[Dict[str, Tensor]] = []
        while expert_key(prefix, len(experts), "w_in") in state:
            slot = len(experts)
            experts.append({name: state[expert_key(prefix, slot, name)] for name in self.expert_layout()})
        return experts

    def to_fused_layout(self, state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
        """Our state dict (or gradients by our keys) -> transformers' in-memory keys, for the MoE blocks at
        ``prefixes`` (experts fused in bank order); other keys unchanged."""
        out: Dict[str, Tensor] = {}
        for prefix in prefixes:
            out |= {f"{prefix}.{key}": t for key, t in self.fuse_experts(self.experts_of(state, prefix)).items()}
            routers = {f"{prefix}.moe.router.{name}": f"{prefix}.{key}" for name, key in self.router_keys().items()}
            out |= {stock: state[ours] for ours, stock in routers.items() if ours in state}
        return out | _others(state, prefixes)

    def from_fused_layout(self, fused: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
        """transformers' in-memory state dict -> our keys (native router): to_fused_layout's inverse."""
        taken = {f"{prefix}.{key}" for prefix in prefixes for key in self.fused_keys()}
        out: Dict[str, Tensor] = {}
        for prefix in prefixes:
            block = {key: fused[f"{prefix}.{key}"] for key in self.fused_keys()}
            for expert in range(block[self.fused_keys()[0]].shape[0]):
                out |= {expert_key(prefix, expert, n): t for n, t in self.expert_tensors(block, expert).items()}
            routers = {f"{prefix}.moe.router.{name}": f"{prefix}.{key}" for name, key in self.router_keys().items()}
            out |= {ours: fused[key] for ours, key in routers.items() if key in fused}
            taken |= set(routers.values())
        return out | {key: value for key, value in fused.items() if key not in taken}

    def to_checkpoint_layout(self, state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
        """Our state dict -> the keys save_pretrained writes (per-expert keys, Mixtral's block_sparse_moe
        name; gpt-oss's fused tensors), for the MoE blocks at ``prefixes``; other keys unchanged."""
        out: Dict[str, Tensor] = {}
        for prefix in prefixes:
            experts = self.experts_of(state, prefix)
            if self.checkpoint_experts is None:
                out |= {f"{prefix}.{key}": t for key, t in self.fuse_experts(experts).items()}
            else:
                for expert, params in enumerate(experts):
                    out |= {key: params[n] for n, key in self.checkpoint_expert_keys(prefix, expert).items()}
            for name, key in self.checkpoint_router_keys(prefix).items():
                if f"{prefix}.moe.router.{name}" in state:
                    out[key] = state[f"{prefix}.moe.router.{name}"]
        return out | _others(state, prefixes)
