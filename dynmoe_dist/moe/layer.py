"""MoELayer: router -> dispatcher (injected) -> experts -> combine.

Shape legend: T tokens, D model dim, E experts (logical), e local experts, R routed rows.

The layer is single-process math. Expert parallelism swaps in another dispatcher (and a statistics
reducer for the auxiliary losses) from ``dynmoe_dist.parallel``; the layer's code does not change, and
where its experts live is recorded there (``parallel.shard.LayerShard``), not on the layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from . import losses
from .config import MoEConfig
from .experts import ExpertBank, expert_from_named
from .permute import combine_rows, gather_rows, routed_pairs
from .routing import NativeRule, Routing, gate_dtype, native, top_any, top_k, top_p


@dataclass
class MoEOutput:
    output: Tensor
    """Same shape as the input."""
    aux_loss: Tensor
    """Scalar, already multiplied by ``aux_loss_weight`` (and, under data parallelism, by 1/world so
    that the sum over ranks is the loss of the global batch)."""
    routing: Routing
    balance: Optional[losses.BalanceTerm] = None
    """This layer's share of the joint load-balance loss of a native router whose checkpoint asks for it
    (training only): the caller hands it to the aux collection, whose owner forms the loss over all layers."""


class Dispatcher(Protocol):
    """dispatch returns (rows, counts per local expert, metadata); combine consumes that metadata, whose
    type is the dispatcher's own (LocalMeta, A2AMeta)."""

    def dispatch(self, x_TD: Tensor, routing: Routing) -> Tuple[Tensor, Tensor, Any]: ...

    def combine(self, rows_RD: Tensor, meta: Any) -> Tensor: ...


class Reducer(Protocol):
    """Sums the aux losses' token statistics over the data ranks; ``loss_scale`` keeps their sum exact."""

    loss_scale: float

    def sum(self, t: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class LocalMeta:
    token_R: Tensor
    weight_R: Tensor
    num_tokens: int
    sizes_e: Optional[Tuple[int, ...]] = None
    """Rows per expert as Python ints (read once in routed_pairs), for the per-expert loop."""


class LocalDispatcher:
    """All experts live in this process: permute, and combine with an index-add."""

    def dispatch(self, x_TD: Tensor, routing: Routing) -> Tuple[Tensor, Tensor, LocalMeta]:
        pairs = routed_pairs(routing)
        rows_RD = gather_rows(x_TD, pairs.token_R)
        return rows_RD, pairs.counts_E, LocalMeta(pairs.token_R, pairs.weight_R, x_TD.shape[0], pairs.sizes_E)

    def combine(self, rows_RD: Tensor, meta: LocalMeta) -> Tensor:
        return combine_rows(rows_RD, meta.token_R, meta.weight_R, meta.num_tokens)


class LocalReducer:
    """Token statistics of the auxiliary losses summed over one process (identity)."""

    loss_scale = 1.0

    def sum(self, t: Tensor) -> Tensor:
        return t


class TopAnyRouter(nn.Module):
    """DynMoE gate: gate vectors W (E x D, orthogonal init) and thresholds G (E, init 0)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(nn.init.orthogonal_(torch.empty(config.num_experts, config.dim)))
        self.threshold = nn.Parameter(torch.full((config.num_experts,), float(config.threshold_init)))

    def forward(self, x_TD: Tensor, training: bool) -> Routing:
        return top_any(
            x_TD,
            self.weight,
            self.threshold,
            training=training,
            train_k0=self.config.train_k0,
            eval_k0=self.config.eval_k0,
            combine=self.config.combine,
        )

    def resize(self, keep: List[int], new_weight_ND: Tensor) -> None:
        """Keep the given experts (in that order) and append new gate vectors with threshold 0."""
        with torch.no_grad():
            weight = torch.cat([self.weight[keep], new_weight_ND.to(self.weight)])
            threshold = torch.cat([self.threshold[keep], self.threshold.new_zeros(len(new_weight_ND))])
        self.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)  # frozen under LoRA stays
        self.threshold = nn.Parameter(threshold, requires_grad=self.threshold.requires_grad)


class SoftmaxRouter(nn.Module):
    """Linear router + softmax, selecting top-k or top-p (the baselines).

    With moe.balance = 'bias' a top-k router also holds ``choice_bias`` (E), a buffer added to the
    probabilities for choosing only, which moe/balance.py moves after each step (DeepSeek-V3's rule). Without
    it the buffer is absent, so the router's state is the plain baseline's."""

    choice_bias: Optional[Tensor]

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim).normal_(0, config.init_std))
        bias = torch.zeros(config.num_experts) if config.balance == "bias" and config.router == "top_k" else None
        self.register_buffer("choice_bias", bias)

    def forward(self, x_TD: Tensor, training: bool) -> Routing:
        dtype = torch.promote_types(gate_dtype(x_TD), self.weight.dtype)
        logits_TE = x_TD.to(dtype) @ self.weight.to(dtype).t()
        if self.config.router == "top_k":
            return top_k(logits_TE, self.config.top_k, self.choice_bias)
        return top_p(logits_TE, self.config.top_p)

    def resize(self, keep: List[int], new_weight_ND: Tensor) -> None:
        """Keep the given experts (in that order) and append new ones (choice bias 0, DeepSeek's start)."""
        with torch.no_grad():
            weight = torch.cat([self.weight[keep], new_weight_ND.to(self.weight)])
            if self.choice_bias is not None:
                old = self.choice_bias
                self.choice_bias = torch.cat([old[keep], old.new_zeros(len(new_weight_ND))])
        self.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)  # frozen under LoRA stays


class NativeRouter(nn.Module):
    """An imported transformers MoE family's router with the family's parameters and rule (``NativeRule``):
    weight (E, D), a bias (E) for gpt-oss, DeepSeek's e_score_correction_bias (E).

    The correction bias stays a buffer, as in transformers: it only moves which experts are chosen (the
    weights use the scores without it), so no gradient reaches it; DeepSeek adjusts it outside the gradient
    (its auxiliary-loss-free balancing), which runs here only with moe.balance = 'bias' (moe/balance.py):
    by default it keeps the checkpoint's values, as transformers' forward does. As a buffer it follows the
    model's device, is saved, and is sliced with the experts."""

    e_score_correction_bias: Optional[Tensor]

    def __init__(self, config: MoEConfig, rule: NativeRule):
        super().__init__()
        rule.check_experts(config.num_experts)
        if config.balance == "bias" and not rule.correction_bias:
            raise ValueError(
                "balance ('bias') needs choice scores to bias: this family's native router has no correction "
                "bias (DeepSeek-V3's e_score_correction_bias); use router 'top_k' or 'top_any', or balance 'off'"
            )
        self.config = config
        self.rule = rule
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim).normal_(0, config.init_std))
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if rule.router_bias else None
        correction = torch.zeros(config.num_experts) if rule.correction_bias else None
        self.register_buffer("e_score_correction_bias", correction)

    def forward(self, x_TD: Tensor, training: bool) -> Routing:
        return native(x_TD, self.weight, self.rule, bias_E=self.bias, correction_E=self.e_score_correction_bias)

    def resize(self, keep: List[int], new_weight_ND: Tensor) -> None:
        """Keep the given experts (in that order) and append new ones: router rows ``new_weight_ND``, bias 0,
        correction bias 0 (DeepSeek's initial value). Every per-expert tensor is sliced the same way."""
        self.rule.check_experts(len(keep) + len(new_weight_ND))
        with torch.no_grad():
            weight = torch.cat([self.weight[keep], new_weight_ND.to(self.weight)])
            if self.bias is not None:
                bias = torch.cat([self.bias[keep], self.bias.new_zeros(len(new_weight_ND))])
                self.bias = nn.Parameter(bias, requires_grad=self.bias.requires_grad)
            if self.e_score_correction_bias is not None:
                old = self.e_score_correction_bias
                self.e_score_correction_bias = torch.cat([old[keep], old.new_zeros(len(new_weight_ND))])
        self.weight = nn.Parameter(weight, requires_grad=self.weight.requires_grad)  # frozen under LoRA stays


Router = Union[TopAnyRouter, SoftmaxRouter, NativeRouter]


def make_router(config: MoEConfig, rule: Optional[NativeRule] = None) -> Router:
    """The router ``config.router`` names; a native one needs the checkpoint's rule, and only it reads one."""
    if config.router == "native":
        if rule is None:
            raise ValueError(
                "router ('native') needs the checkpoint's routing rule (a NativeRule, from "
                "models/hf/families/): it is only for imported transformers MoE models"
            )
        return NativeRouter(config, rule)
    if rule is not None:
        raise ValueError(f"a NativeRule is read only by router 'native', router is {config.router!r}")
    return TopAnyRouter(config) if config.router == "top_any" else SoftmaxRouter(config)


RoutingObserver = Callable[["MoELayer", Tensor, Routing], None]

_recompute_depth = 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks a forward that activation checkpointing replays in the backward pass: the routing it
    recomputes was already observed once, so observers (statistics, telemetry) must not see it again."""
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def is_recomputing() -> bool:
    return _recompute_depth > 0


def rebuild_experts(layer: "MoELayer", num_experts: int, experts: Sequence[Mapping[str, Tensor]]) -> None:
    """Set the layer to ``num_experts`` logical experts, holding ``experts`` (each by parameter name; the ones
    this process holds, in slot order). The router gets zero rows at the new count: its values are dense
    state, loaded next by whoever rebuilds (a resume, an export)."""
    like = layer.router.weight
    layer.router.resize([], like.new_zeros(num_experts, like.shape[1]))
    layer.experts.set_experts([expert_from_named(named, layer.config, like) for named in experts])


def dense_state_tensors(model: nn.Module) -> List[Tuple[str, Tensor]]:
    """(name, tensor) of everything a model's dense state holds: every parameter that is not an expert's
    (routers included) and every saved buffer of the MoE routers (DeepSeek-V3's correction bias, which no
    gradient trains but events slice). Experts are saved apart, by logical id."""
    layers = [layer for _, layer in find_moe_layers(model)]
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters()}
    router_buffers = {id(b) for layer in layers for b in layer.router.buffers()}
    params = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_ids]
    return params + [(n, b) for n, b in model.named_buffers() if id(b) in router_buffers]


def find_moe_layers(model: nn.Module) -> List[Tuple[str, "MoELayer"]]:
    """(qualified name, layer) of every MoE layer, in module order: the layer index used everywhere."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def block_index(name: str) -> Optional[int]:
    """The model block a qualified MoE layer name sits in: its first integer path component
    ('hf.model.layers.4.mlp.moe' -> 4, 'stack.blocks.1.ffn' -> 1); None when it has none ('' for a
    bare layer). Users number blocks as the model does (model.moe_layers), not by MoE layer position."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def block_labels(names: List[str]) -> List[int]:
    """What reports and event lines call each MoE layer: its block index, or its position among the MoE
    layers for every layer when some name has no block or two layers share one (labels must be unique)."""
    blocks = [block_index(name) for name in names]
    if None in blocks or len(set(blocks)) != len(blocks):
        return list(range(len(names)))
    return [b for b in blocks if b is not None]


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, experts: Optional[ExpertBank] = None, rule: Optional[NativeRule] = None):
        super().__init__()
        self.config = config
        self.router: Router = make_router(config, rule)
        self.experts = experts if experts is not None else ExpertBank.fresh(config, config.num_experts)
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.reducer: Reducer = LocalReducer()
        # Observers see every routing decision (the adaptive-expert recorder hooks in here).
        self.routing_observers: List[RoutingObserver] = []

    @property
    def num_experts(self) -> int:
        return self.router.weight.shape[0]

    def forward(self, x: Tensor) -> MoEOutput:
        if x.shape[-1] != self.config.dim:
            raise ValueError(f"input last dimension ({x.shape[-1]}) != dim ({self.config.dim})")
        x_TD = x.reshape(-1, self.config.dim)
        routing = self.router(x_TD, self.training)
        rows_RD, counts_e, meta = self.dispatcher.dispatch(x_TD, routing)
        # A dispatcher that has read the expert counts already hands them over (no second host sync).
        rows_RD = self.experts(rows_RD, counts_e, getattr(meta, "sizes_e", None))
        out_TD = self.dispatcher.combine(rows_RD, meta)
        if not is_recomputing():
            for observe in self.routing_observers:
                observe(self, x_TD, routing)
        out = out_TD.reshape(x.shape).to(x.dtype)
        return MoEOutput(out, self.aux_loss(routing), routing, self.balance_term(routing))

    def balance_term(self, routing: Routing) -> Optional[losses.BalanceTerm]:
        """This layer's statistics for its family's joint load-balance loss, when the checkpoint asks for one."""
        if not self.training or not isinstance(self.router, NativeRouter) or routing.logits is None:
            return None
        rule = self.router.rule
        if not rule.output_router_logits or rule.aux_loss_coef == 0:
            return None
        return losses.balance_term(
            routing.logits, rule.top_k, rule.aux_loss_coef, self.reducer.sum, self.reducer.loss_scale
        )

    def aux_loss(self, routing: Routing) -> Tensor:
        # Evaluation needs no aux loss, and skipping it saves the statistics collectives.
        if not self.training or not self.config.aux_losses or self.config.aux_loss_weight == 0:
            return routing.weights.new_zeros(())
        names = self.config.aux_losses
        # All token statistics of this layer travel in one reduction (one all-reduce under data parallelism).
        token_names = [n for n in names if n in losses.TOKEN_LOSSES]
        by_name = dict(zip(token_names, losses.token_losses(token_names, routing, self.reducer.sum)))
        if "diverse" in names:
            by_name["diverse"] = losses.diverse_loss(self.router.weight)
        if "simple" in names:
            by_name["simple"] = losses.simple_loss(self.router.weight)
        terms = [by_name[n] for n in names]
        return self.config.aux_loss_weight * self.reducer.loss_scale * torch.stack(terms).sum()
