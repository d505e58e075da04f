"""Between an imported MoE model's keys and transformers' (in memory, and in the checkpoint files), both ways.

Shape legend: E experts, D model dim, F expert hidden dim.

For MoE block i at prefix P (``model.layers.3.mlp``; ``moe_families.sparse_block_prefixes`` lists them):
  ours                                   transformers in memory ("fused")   checkpoint files
  P.moe.experts.experts.{e}.w_gate/w_in  P.experts.gate_up_proj[e] halves   P.experts.{e}.gate_proj/up_proj
    /w_out (+ b_gate/b_in/b_out:          (gpt-oss: interleaved columns,     /down_proj.weight (Mixtral:
    gpt-oss)                              transposed, + biases),             ...block_sparse_moe.experts.{e}
                                          P.experts.down_proj[e]             .w1/w3/w2.weight; gpt-oss: fused)
  P.moe.router.weight (+ .bias)          P.gate.weight (gpt-oss P.router.*)  the same (Mixtral: block_sparse_moe)
  P.moe.router.e_score_correction_bias   P.gate.e_score_correction_bias      the same
  every other key (shared experts too)   the same key                       the same key

Reading: ``expert_sources`` says which key and which slice give each parameter of logical expert e, in
either layout, so a rank reads its own experts only (``read_expert`` with a ``CheckpointReader``; it finds
which layout the files hold). Writing: ``save_stock`` writes what save_pretrained writes for the experts a
model holds now (after removals), with the expert count of the config reduced: plain transformers loads
it (no trust_remote_code). ``to_fused_layout`` maps our state (or gradients) onto transformers' in-memory
parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Union, cast

import torch.nn as nn
from torch import Tensor

from ...moe.layer import NativeRouter
from .export_files import MAX_SHARD_SIZE, save_weights
from .moe_families import Index, MoEFamily, expert_tensors, family_of, fuse_experts
from .pretrained import unshared
from .safetensors_reader import CheckpointReader
from .upcycle import MoEBlock


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


def expert_sources(family: MoEFamily, prefix: str, expert: int, fused: bool) -> Dict[str, ExpertSource]:
    """Parameter name -> where logical expert ``expert`` of the block at ``prefix`` keeps it: in fused tensors
    (``fused``: transformers' in-memory keys, gpt-oss's files) or in the per-expert keys of the checkpoint files."""
    if fused or family.checkpoint_experts is None:
        return {
            name: ExpertSource(f"{prefix}.{s.key}", s.full_index(expert), s.transpose)
            for name, s in family.expert_layout().items()
        }
    return {name: ExpertSource(key) for name, key in family.checkpoint_expert_keys(prefix, expert).items()}


def router_sources(family: MoEFamily, prefix: str) -> Dict[str, str]:
    """Our key of each native router tensor -> transformers' in-memory key."""
    return {f"{prefix}.moe.router.{name}": f"{prefix}.{key}" for name, key in family.router_keys().items()}


# -- reading a checkpoint directory ----------------------------------------------------------------
def holds_fused(reader: CheckpointReader, family: MoEFamily, prefix: str) -> bool:
    """Whether the files keep the block's experts fused (gpt-oss; a state_dict saved as it is) rather than
    one key per expert (what save_pretrained writes for the other families)."""
    return f"{prefix}.{family.fused_keys()[0]}" in reader.files


def _expected_shapes(family: MoEFamily) -> Dict[str, tuple]:
    d, f = int(family.config.hidden_size), family.ffn_dim()
    return {"w_gate": (f, d), "w_in": (f, d), "w_out": (d, f), "b_gate": (f,), "b_in": (f,), "b_out": (d,)}


def _shape_error(reader: CheckpointReader, key: str, have: tuple, want: tuple, family: MoEFamily) -> ValueError:
    return ValueError(
        f"{reader.file_of(key)}: {key} has shape {have}, but the config ({family.num_experts_key} "
        f"{family.num_experts()}, hidden_size {family.config.hidden_size}, {family.ffn_key} {family.ffn_dim()}) "
        f"gives {want}"
    )


def check_expert_shapes(reader: CheckpointReader, family: MoEFamily, prefix: str, expert: int) -> None:
    """ValueError naming the file and key when a stored tensor of this expert (a fused tensor: all experts)
    disagrees with the config."""
    if holds_fused(reader, family, prefix):
        wanted = {f"{prefix}.{key}": want for key, want in family.fused_shapes(family.num_experts()).items()}
    else:
        shapes = _expected_shapes(family)
        wanted = {key: shapes[name] for name, key in family.checkpoint_expert_keys(prefix, expert).items()}
    for key, want in wanted.items():
        have = reader.shape(key)
        if have != want:
            raise _shape_error(reader, key, have, want, family)


def check_block_shapes(reader: CheckpointReader, family: MoEFamily, prefix: str) -> None:
    """Every expert of the block as the config says (headers only: no tensor data is read)."""
    for expert in range(family.num_experts()):
        check_expert_shapes(reader, family, prefix, expert)


def read_expert(reader: CheckpointReader, family: MoEFamily, prefix: str, expert: int) -> Dict[str, Tensor]:
    """Logical expert ``expert`` of the block at ``prefix``: parameter name -> tensor, reading only its slices."""
    check_expert_shapes(reader, family, prefix, expert)
    sources = expert_sources(family, prefix, expert, holds_fused(reader, family, prefix))
    return {name: source.read(reader) for name, source in sources.items()}


def read_router(reader: CheckpointReader, family: MoEFamily, prefix: str) -> Dict[str, Tensor]:
    """The block's native router tensors by name (weight, bias, e_score_correction_bias), read whole: they
    are small and every rank routes over all experts."""
    return {name: reader.tensor(key) for name, key in family.checkpoint_router_keys(prefix).items()}


# -- our state in transformers' layouts ----------------------------------------------------------------
def _experts_of(family: MoEFamily, state: Mapping[str, Tensor], prefix: str) -> List[Dict[str, Tensor]]:
    """The block's experts in bank order (keys numbered 0..), parameter name -> tensor."""
    experts: List[Dict[str, Tensor]] = []
    while expert_key(prefix, len(experts), "w_in") in state:
        slot = len(experts)
        experts.append({name: state[expert_key(prefix, slot, name)] for name in family.expert_layout()})
    return experts


def _others(state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
    ours = tuple(f"{prefix}.moe." for prefix in prefixes)
    return {key: value for key, value in state.items() if not key.startswith(ours)}


def to_fused_layout(family: MoEFamily, state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
    """Our state dict (or gradients by our keys) -> transformers' in-memory keys, for the MoE blocks at
    ``prefixes`` (experts fused in bank order); other keys unchanged."""
    out: Dict[str, Tensor] = {}
    for prefix in prefixes:
        out |= {f"{prefix}.{key}": t for key, t in fuse_experts(family, _experts_of(family, state, prefix)).items()}
        out |= {stock: state[ours] for ours, stock in router_sources(family, prefix).items() if ours in state}
    return out | _others(state, prefixes)


def from_fused_layout(family: MoEFamily, fused: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
    """transformers' in-memory state dict -> our keys (native router): to_fused_layout's inverse."""
    taken = {f"{prefix}.{key}" for prefix in prefixes for key in family.fused_keys()}
    out: Dict[str, Tensor] = {}
    for prefix in prefixes:
        block = {key: fused[f"{prefix}.{key}"] for key in family.fused_keys()}
        for expert in range(block[family.fused_keys()[0]].shape[0]):
            out |= {expert_key(prefix, expert, n): t for n, t in expert_tensors(family, block, expert).items()}
        routers = router_sources(family, prefix)
        out |= {ours: fused[key] for ours, key in routers.items() if key in fused}
        taken |= set(routers.values())
    return out | {key: value for key, value in fused.items() if key not in taken}


def to_checkpoint_layout(family: MoEFamily, state: Mapping[str, Tensor], prefixes: Sequence[str]) -> Dict[str, Tensor]:
    """Our state dict -> the keys save_pretrained writes (per-expert keys, Mixtral's block_sparse_moe name;
    gpt-oss's fused tensors), for the MoE blocks at ``prefixes``; other keys unchanged."""
    out: Dict[str, Tensor] = {}
    for prefix in prefixes:
        experts = _experts_of(family, state, prefix)
        if family.checkpoint_experts is None:
            out |= {f"{prefix}.{key}": t for key, t in fuse_experts(family, experts).items()}
        else:
            for expert, params in enumerate(experts):
                out |= {key: params[n] for n, key in family.checkpoint_expert_keys(prefix, expert).items()}
        for name, key in family.checkpoint_router_keys(prefix).items():
            if f"{prefix}.moe.router.{name}" in state:
                out[key] = state[f"{prefix}.moe.router.{name}"]
    return out | _others(state, prefixes)


# -- writing the stock checkpoint back -------------------------------------------------------------------
def imported_blocks(model: nn.Module) -> List[tuple]:
    """(prefix, block) of every MoE block of an imported model, in order (block i)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]


def _native_router(prefix: str, block: MoEBlock) -> NativeRouter:
    router = block.moe.router
    if not isinstance(router, NativeRouter):
        raise ValueError(
            f"{prefix}: router {block.moe.config.router!r} has no stock transformers equivalent; only router "
            "'native' can be written back in the checkpoint's layout (use python -m dynmoe_dist.export)"
        )
    return router


def stock_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The model's state as save_pretrained writes it: every MoE block's experts (in bank order) and router
    rows in the checkpoint's keys, every other key as it is. One expert count for all blocks (the stock
    config has one), native routers only."""
    blocks = imported_blocks(model)
    counts = [block.moe.num_experts for _, block in blocks]
    if len(set(counts)) > 1:
        raise ValueError(f"the stock layout has one expert count per model; the MoE blocks have {counts}")
    prefixes = [prefix for prefix, block in blocks if _native_router(prefix, block)]
    return to_checkpoint_layout(family_of(model), model.state_dict(), prefixes)


def stock_config(model: nn.Module) -> Any:
    """A copy of the model's config with its current expert count, and transformers' own load-balance switch
    back as the checkpoint had it (the import moved the loss to the aux collection)."""
    family = family_of(model)
    blocks = imported_blocks(model)
    config = copy.deepcopy(cast(Any, model).config)
    if blocks:
        family.with_num_experts(config, blocks[0][1].moe.num_experts)
        routers = [_native_router(prefix, block) for prefix, block in blocks]
        config.output_router_logits = any(router.rule.output_router_logits for router in routers)
    family_of(config)  # the reduced count must still route (DeepSeek's groups divide it, top-k fits)
    return config


def save_stock(model: nn.Module, directory: Union[str, Path], max_shard_size: Union[int, str] = MAX_SHARD_SIZE) -> Path:
    """Write the model as save_pretrained would: config.json (+ generation_config.json) and model.safetensors
    (shards + index above ``max_shard_size``) in the checkpoint's layout; ``from_pretrained`` loads it
    without trust_remote_code."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = unshared(stock_state_dict(model))
    config = stock_config(model)
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))
    save_weights(state, out, max_shard_size)
    return out
