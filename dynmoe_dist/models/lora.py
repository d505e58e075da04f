"""LoRA finetuning of a model: the ``[lora]`` options, adapters on the targeted projections, the rest frozen.

Shape legend: r rank, K a projection's input features, N its output features.

Targets, by name (``TARGETS``): the attention projections, the dense MLPs (decoder layers without experts),
the routed experts (one adapter per expert and projection: moe/adapters.py, made by the MoE layers
themselves from ``MoEConfig.adapter_rank``, which ``expert_config`` sets) and the shared experts. A dense
projection keeps its module and its parameter names (so a checkpoint reads the base by its own keys): its
adapter is two parameters ``lora_a`` (r, K) and ``lora_b`` (N, r) registered on the nn.Linear, whose
forward hook adds (alpha / r) (x A^T) B^T, PEFT's ``lora.Linear`` in another form. Every other parameter is
frozen (no gradient, hence no optimizer state and no gradient all-reduce: train/optim.py and
parallel/grads.py take only what requires a gradient), the routers too unless ``router = 'trainable'``.

Adapters are drawn (``init_adapters``) by name from the seed: a dense adapter by its module's name, an
expert's by its MoE layer and logical id, so every world size and expert placement starts from the same
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple, Union, cast

import torch
import torch.nn as nn
from torch import Tensor

from ..moe import frozen_base, nf4
from ..moe.adapters import SIDES, drawn_a, has_adapters, is_adapter, lora_delta, scaling, seeded_generator
from ..moe.config import ADDED_EXPERTS, BASE_DTYPES, MoEConfig, _require
from ..moe.experts import expert_key
from ..moe.layer import MoELayer
from .source import FillRows, HeldExperts

# target -> what it adapts (the message of a target that names nothing lists the ones that exist)
TARGETS = {
    "attention": "the attention projections (every nn.Linear under a decoder layer's self_attn)",
    "dense_mlp": "the MLPs of the decoder layers without experts",
    "routed_experts": "every routed expert, one adapter per expert and projection (gate and up share one)",
    "shared_experts": "the always-on shared experts (DeepSeek-V3's shared_experts, Qwen2-MoE's shared_expert)",
}
ROUTER_MODES = ("frozen", "trainable")
_SHARED = (".shared_experts.", ".shared_expert.")
# Qwen2-MoE's shared_expert_gate, a (1, D) projection scaling the shared expert: a gate of the sparse block, as
# its router is, not a dense MLP (under 'dense_mlp' it took a rank-1 adapter, and any rank above 1 was refused)
_GATES = (".shared_expert_gate.",)


@dataclass
class LoraConfig:
    """The ``[lora]`` options: which projections get adapters and how they start."""

    enabled: bool = False
    """Finetune with LoRA: train adapters on the targets below, every other weight frozen (no gradient, no
    optimizer state). Imported transformers MoEs and upcycled transformers models (model.source = 'hf')."""
    rank: int = 8
    """Rank r of every adapter: A (r, in), B (out, r). At most the smallest dimension of a targeted weight."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's lora_alpha)."""
    targets: Tuple[str, ...] = tuple(TARGETS)
    """What gets adapters, by name: 'attention', 'dense_mlp', 'routed_experts', 'shared_experts'. Each must name
    something in the model."""
    router: str = "frozen"
    """The routers: 'frozen' (PEFT's default: the routing of the base stays) or 'trainable' (trained in full)."""
    base_dtype: str = "run"
    """How the frozen base is stored (moe/frozen_base.py): 'run' (train.precision's dtype), 'bfloat16' (every frozen
    weight of a linear layer or an embedding and the routed experts' weights, 2 bytes a weight) or 'nf4' (QLoRA: the
    adapted projections' and the routed experts' weights 4-bit, moe/nf4.py, needs torchao; the other frozen linear
    and embedding weights bf16). Computed in the run's dtype (each use widens or dequantises it), so adapters, a
    trainable router and the optimizer keep that dtype; norms, routers and biases stay in it. Under FSDP an NF4
    projection stays whole on every rank (its adapters sharded); NF4 experts cannot be FSDP-sharded."""
    added_experts: str = "copy"
    """What an expert an adaptive event adds is (with 'routed_experts' among the targets; without them the experts have
    no adapters and an added expert trains in full): its frozen weights are always the combination of old experts
    that adaptive.expert_init names; 'copy' gives it their adapters too (a seeded random expert, which has none to
    copy, gets fresh ones as below), 'fresh_adapter' fresh adapters as PEFT starts them (A drawn from the event's
    seed, B zero: the expert starts as its source's base), 'trainable' their adapters and trains its own weights
    too (all saved in a LoRA checkpoint)."""

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        _require(self.rank >= 1, f"lora.rank ({self.rank}) must be >= 1")
        _require(self.alpha > 0, f"lora.alpha ({self.alpha}) must be > 0")
        _require(bool(self.targets), f"lora.targets ({list(self.targets)}) must name at least one of {tuple(TARGETS)}")
        for target in self.targets:
            _require(target in TARGETS, f"lora.targets entry ({target!r}) must be one of {tuple(TARGETS)}")
        _require(len(set(self.targets)) == len(self.targets), f"lora.targets ({list(self.targets)}) repeats a name")
        _require(self.router in ROUTER_MODES, f"lora.router ({self.router!r}) must be one of {ROUTER_MODES}")
        _require(self.base_dtype in BASE_DTYPES, f"lora.base_dtype ({self.base_dtype!r}) must be one of {BASE_DTYPES}")
        _require(
            self.added_experts in ADDED_EXPERTS,
            f"lora.added_experts ({self.added_experts!r}) must be one of {ADDED_EXPERTS}",
        )
        _require(
            self.added_experts != "fresh_adapter" or "routed_experts" in self.targets,
            f"lora.added_experts ('fresh_adapter') needs 'routed_experts' in lora.targets ({list(self.targets)}): "
            "without expert adapters an added expert trains in full",
        )
        _require(
            self.added_experts != "trainable" or self.base_dtype == "run",
            f"lora.added_experts ('trainable') needs lora.base_dtype 'run', got {self.base_dtype!r}: an added expert's "
            "own weights would train in the stored (bfloat16 or NF4) base",
        )
        if self.base_dtype == "nf4":
            nf4.check_backend()


def expert_config(moe: MoEConfig, lora: LoraConfig) -> MoEConfig:
    """``moe`` with the routed experts' adapters (none without LoRA or when 'routed_experts' is no target): build
    the model with it."""
    base_dtype = lora.base_dtype if lora.enabled else "run"
    if not lora.enabled or "routed_experts" not in lora.targets:
        return replace(moe, adapter_rank=0, adapter_alpha=0.0, base_dtype=base_dtype)
    return replace(
        moe,
        adapter_rank=lora.rank,
        adapter_alpha=lora.alpha,
        base_dtype=base_dtype,
        added_experts=lora.added_experts,
    )


def dense_targets(model: nn.Module) -> Dict[str, List[Tuple[str, nn.Linear]]]:
    """Dense target -> (qualified name, nn.Linear) of what it names in ``model`` (empty lists included)."""
    found: Dict[str, List[Tuple[str, nn.Linear]]] = {"attention": [], "dense_mlp": [], "shared_experts": []}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        dotted = f".{name}."
        if any(gate in dotted for gate in _GATES):
            continue
        if ".self_attn." in dotted:
            found["attention"].append((name, module))
        elif any(s in dotted for s in _SHARED):
            found["shared_experts"].append((name, module))
        elif ".mlp." in dotted:
            found["dense_mlp"].append((name, module))
    return found


def moe_layers(model: nn.Module) -> List[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def apply_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Adapters on every dense target, every parameter that is no adapter frozen (routers as ``lora.router``
    says). The MoE layers must have been built with ``expert_config``. One-line ValueErrors, before anything
    changes: a target that names nothing (listing those that exist), a rank above a target's smallest dimension.
    With ``base_dtype = 'nf4'`` the weights are stored NF4 afterwards, by ``quantize_base``."""
    dense = dense_targets(model)
    layers = moe_layers(model)
    present = [t for t in TARGETS if (dense[t] if t in dense else layers)]
    for target in lora.targets:
        if target not in present:
            raise ValueError(
                f"lora.targets entry ({target!r}) names nothing in this model; it has: {', '.join(present)}"
            )
    if "routed_experts" in lora.targets:
        _check_expert_adapters(layers, lora)
    chosen = [(name, linear) for t in lora.targets if t in dense for name, linear in dense[t]]
    for name, linear in chosen:
        _check_rank(lora.rank, name, tuple(linear.weight.shape))
    if lora.base_dtype == "nf4":
        nf4.check_blocks(base_weights(chosen, layers))  # what quantize_base will store, checked while on meta
    for _, linear in chosen:
        add_dense_adapter(linear, lora.rank, lora.alpha)
    freeze_base(model, lora.router == "trainable")


def quantize_base(model: nn.Module) -> None:
    """QLoRA (``base_dtype = 'nf4'``): the frozen weights of every adapted dense projection and of every routed
    expert stored NF4 (moe/nf4.py), on a model ``apply_lora`` made and whose weights are final (a later
    ``model.to(dtype)`` would dequantise them). One-line ValueError, before any changes, for a weight NF4 cannot
    store."""
    nf4.quantize(base_weights(adapted_linears(model), moe_layers(model)))


def check_run_support(lora: LoraConfig, expert_sharding: str) -> None:
    """An NF4 expert cannot be FSDP-sharded over its expert-dp group: torchao's NF4 shards only cut whole blocks
    and scale blocks (and keep one scale mean), which an expert's rows split over its group need not."""
    if lora.enabled and lora.base_dtype == "nf4" and expert_sharding == "fsdp":
        raise ValueError(
            "lora.base_dtype ('nf4') with parallel.expert_sharding ('fsdp'): NF4 experts are not FSDP-sharded; "
            "use expert_sharding = 'none' or base_dtype = 'bfloat16'"
        )


def lower_base(model: nn.Module, lora: LoraConfig, dtype: torch.dtype) -> None:
    """A low-precision base: every frozen weight of an nn.Linear or nn.Embedding (tied ones stay tied) stored bf16
    and computed in ``dtype`` (moe/frozen_base.py), and with 'bfloat16' every routed expert's frozen weights too.
    NF4 leaves the adapted projections and the experts to ``quantize_base`` (it quantises filled weights). Called
    once the model has its dtype and before FSDP shards it (on the meta device for a source filled later)."""
    lowered: Dict[int, nn.Parameter] = {}
    for module, storage in frozen_dense(model, lora):
        weight = module.weight
        if storage != "bfloat16":
            continue
        if id(weight) not in lowered:
            lowered[id(weight)] = nn.Parameter(frozen_base.stored(weight, "bfloat16"), requires_grad=False)
        module.weight = lowered[id(weight)]
        if isinstance(module, nn.Linear):
            frozen_base.upcast_forward(module)
        else:
            frozen_base.upcast_output(module, dtype)
    if lora.enabled and lora.base_dtype == "bfloat16":
        for layer in moe_layers(model):
            for expert in layer.experts.experts:
                frozen_base.store_expert(expert, "bfloat16")


def frozen_dense(model: nn.Module, lora: LoraConfig) -> List[Tuple[Union[nn.Linear, nn.Embedding], str]]:
    """(module, how it is stored) of every nn.Linear and nn.Embedding whose frozen weight a low-precision base
    stores: 'nf4' for an adapted projection under NF4, 'bfloat16' for every other one; none with 'run'."""
    if not lora.enabled or lora.base_dtype == "run":
        return []
    quantized = {id(p) for p in replicated_base(model, lora)}
    return [
        (module, "nf4" if id(module.weight) in quantized else "bfloat16")
        for module in model.modules()
        if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.requires_grad
    ]


def round_base(model: nn.Module, lora: LoraConfig) -> None:
    """In place, every weight a low-precision base stores rounded as it stores it and widened back (bf16 rounded,
    NF4 quantised and dequantised): the base the run computed with, for a merged export of a model whose weights
    are in the run's dtype."""
    weights: List[Tuple[Tensor, str]] = [(module.weight, storage) for module, storage in frozen_dense(model, lora)]
    if lora.enabled and lora.base_dtype != "run":
        weights += [(weight, lora.base_dtype) for weight in expert_base(model)]
    with torch.no_grad():
        for weight, storage in weights:
            weight.copy_(frozen_base.stored(weight, storage).to(weight.dtype))


def expert_base(model: nn.Module) -> List[Tensor]:
    """The frozen weights of every routed expert the model holds (not their biases nor adapters)."""
    return [
        weight
        for layer in moe_layers(model)
        for expert in layer.experts.experts
        for weight in (getattr(expert, attr, None) for attr in frozen_base.EXPERT_WEIGHTS)
        if weight is not None and not weight.requires_grad
    ]


def replicated_base(model: nn.Module, lora: LoraConfig) -> List[nn.Parameter]:
    """The frozen weights FSDP must leave whole on every rank: the NF4 projections (their adapters are sharded).
    An NF4 weight is quantised from the whole tensor (one scale mean per tensor, the same on every world size), but
    a run fills each FSDP shard after fully_shard from its own rows; FSDP2 could only shard an NF4Tensor quantised
    whole beforehand (torchao cuts its codes and scales by rows), which this order does not do. A bf16 base is
    sharded like any weight."""
    if not lora.enabled or lora.base_dtype != "nf4":
        return []
    return [cast(nn.Parameter, linear.weight) for _, linear in adapted_linears(model)]


def adapted_linears(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "lora_a")]


def base_weights(linears: Sequence[Tuple[str, nn.Linear]], layers: Sequence[MoELayer]) -> List[nf4.Weight]:
    """What QLoRA stores NF4: the adapted dense projections' weights and every routed expert's."""
    weights: List[nf4.Weight] = [(linear, "weight", f"{name}.weight") for name, linear in linears]
    for index, layer in enumerate(layers):
        weights += nf4.expert_weights(list(layer.experts.experts), f"MoE layer {index} expert")
    return weights


def _check_rank(rank: int, name: str, shape: Tuple[int, ...]) -> None:
    if rank > min(shape):
        raise ValueError(f"lora.rank ({rank}) is above the smallest dimension of {name} {shape} ({min(shape)})")


def _check_expert_adapters(layers: Sequence[MoELayer], lora: LoraConfig) -> None:
    for layer in layers:
        config = layer.config
        if config.adapter_rank != lora.rank:
            raise ValueError(
                f"the MoE layers were built with adapter_rank {config.adapter_rank}, lora.rank is {lora.rank}: "
                "build them with models.lora.expert_config"
            )
        _check_rank(lora.rank, "a routed expert", (config.dim, config.ffn_dim))
        # every expert built through experts.new_expert / with_config_adapters: a path that forgot would
        # train nothing there and break migration (its parameters would not match expert_param_specs)
        assert all(has_adapters(e) for e in layer.experts.experts), "MoE layer experts built without adapters"


def add_dense_adapter(linear: nn.Linear, rank: int, alpha: float) -> None:
    """``lora_a`` (r, K) and ``lora_b`` (N, r) on ``linear`` (zeros until ``init_adapters``), added by a hook."""
    out_features, in_features = linear.weight.shape
    like = linear.weight
    linear.lora_a = nn.Parameter(torch.zeros(rank, in_features, device=like.device, dtype=like.dtype))
    linear.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=like.device, dtype=like.dtype))
    linear.lora_scaling = alpha / rank  # type: ignore[assignment]
    linear.lora_hook = linear.register_forward_hook(_add_lora_delta)  # type: ignore[assignment]  # merge removes it


def _add_lora_delta(linear: nn.Module, args: Tuple[Tensor, ...], out_N: Tensor) -> Tensor:
    return out_N + lora_delta(args[0], cast(Tensor, linear.lora_a), cast(Tensor, linear.lora_b), scaling(linear))


def freeze_base(model: nn.Module, train_router: bool) -> None:
    """Only adapters (and, with ``train_router``, the routers) keep requires_grad."""
    routers = {id(p) for layer in moe_layers(model) for p in layer.router.parameters()} if train_router else set()
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or id(p) in routers)


def held_experts(model: nn.Module) -> List[HeldExperts]:
    """Every expert of a model that holds all of them (one process): slot i is logical expert i."""
    return [
        (index, range(len(layer.experts)), list(layer.experts.experts)) for index, layer in enumerate(moe_layers(model))
    ]


def fill_whole(p: Tensor, read: Callable[[int, int], Tensor]) -> None:
    """A ``FillRows`` for a tensor held whole (one process, no FSDP)."""
    p.copy_(read(0, p.shape[0]))


def init_adapters(model: nn.Module, seed: int, held: Sequence[HeldExperts], fill_rows: FillRows = fill_whole) -> None:
    """Draw every adapter (PEFT's init: A kaiming-uniform, B zero) from ``seed`` and its name: a dense one by its
    module's name, an expert's by 'MoE layer/logical id' (``held``: this rank's experts), whatever the world.
    ``fill_rows`` writes a tensor's share (parallel.fsdp.fill_local for FSDP shards)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and hasattr(module, "lora_a"):
            _fill_adapter(module, ("lora_a", "lora_b"), seeded_generator(seed, name), fill_rows)
    for layer, logical_ids, modules in held:
        for expert, module in zip(logical_ids, modules):
            if has_adapters(module):
                generator = seeded_generator(seed, expert_key(layer, expert))
                for names in SIDES.values():
                    _fill_adapter(module, names, generator, fill_rows)


def _fill_adapter(module: nn.Module, names: Tuple[str, str], generator: torch.Generator, fill_rows: FillRows) -> None:
    a_rK, b_Nr = (cast(Tensor, getattr(module, name)) for name in names)
    drawn_rK = drawn_a(a_rK.shape, generator)
    with torch.no_grad():
        fill_rows(a_rK, partial(_rows, drawn_rK.to(a_rK.dtype)))
        fill_rows(b_Nr, partial(_rows, torch.zeros(b_Nr.shape, dtype=b_Nr.dtype)))


def _rows(full: Tensor, start: int, stop: int) -> Tensor:
    return full[start:stop]


def trainable_names(model: nn.Module) -> List[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]
