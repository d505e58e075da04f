"""Building blocks of the expert-parallel benchmark (``bench ep``), kept apart so tests can check them.

Shape legend: T local tokens, D model dim, F expert hidden dim, E global experts, e local experts,
C fairscale's capacity (2T/E), Q rows this rank received.

Everything here runs inside an initialised process group (a simulated gloo cluster or torchrun):
  - our EP layers (top-2 and top-any) and fairscale's ``MOELayer`` + ``Top2Gate`` with the same
    weights (fairscale's experts are copies of our local FeedForward modules, so both sides run the
    same expert code on the same parameters);
  - the bisection that gives top-any the mean k of top-2;
  - the wire-byte accounting of both layers;
  - the parts of the "limit": expert matmuls on exactly the received rows, and bare all_to_all calls.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, cast

import torch
import torch.nn as nn
from torch import Tensor

from ..moe import MoEConfig, MoELayer
from ..moe.layer import TopAnyRouter
from ..parallel.dispatch import exchange_rows
from ..parallel.expert_parallel import parallelize
from ..parallel.groups import ParallelGroups, sum_over_ranks


@dataclass(frozen=True)
class Shapes:
    dim: int = 256
    ffn_dim: int = 1024
    experts_per_rank: int = 4
    tokens: int = 4096
    """Tokens per rank."""

    def num_experts(self, world: int) -> int:
        return self.experts_per_rank * world


# -- the layers --------------------------------------------------------------------------------------
def our_layer(shapes: Shapes, groups: ParallelGroups, router: str, seed: int = 0) -> MoELayer:
    """Our MoE layer sharded over the ep group; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    # preset 'paper': the figures in docs/benchmarks.md time top-any with the reference's four aux losses
    config = MoEConfig(
        dim=shapes.dim,
        ffn_dim=shapes.ffn_dim,
        num_experts=shapes.num_experts(groups.ep_size),
        router=router,
        top_k=2,
        preset="paper",
    )
    layer = MoELayer(config)
    parallelize(layer, groups)
    return layer


def copy_experts(src: MoELayer, dst: MoELayer) -> None:
    """Give `dst` the expert weights of `src` (same placement), so both compute the same matmuls."""
    with torch.no_grad():
        for p_dst, p_src in zip(dst.experts.parameters(), src.experts.parameters()):
            p_dst.copy_(p_src)


def fairscale_layer(ours: MoELayer, groups: ParallelGroups) -> nn.Module:
    """fairscale's MOELayer + Top2Gate with our top-2 layer's weights.

    Top2Gate's ``wg`` is nn.Linear(D, E) without bias: its weight has our SoftmaxRouter's (E, D) layout.
    Its experts are deep copies of our local experts: the same FeedForward code on the same values."""
    from fairscale.nn import MOELayer, Top2Gate

    gate = Top2Gate(ours.config.dim, ours.num_experts)
    with torch.no_grad():
        gate.wg.weight.copy_(ours.router.weight)
    experts = nn.ModuleList(copy.deepcopy(list(ours.experts.experts)))
    return MOELayer(gate, experts, group=groups.ep_group)


def fairscale_input(x_TD: Tensor, num_local_experts: int) -> Tensor:
    """MOELayer wants (s, t, m) with s a multiple of its local expert count; it flattens s and t."""
    return x_TD.reshape(num_local_experts, -1, x_TD.shape[-1])


def fairscale_capacity(num_tokens: int, num_experts: int) -> int:
    """Top2Gate's capacity per expert: 2 T / E (every expert's buffer has exactly this many rows)."""
    return 2 * num_tokens // num_experts


# -- top-any at the mean k of top-2 ------------------------------------------------------------------
def global_mean_k(layer: MoELayer, x_TD: Tensor, groups: ParallelGroups) -> float:
    """Mean selected experts per token over the tokens of every rank (training-mode routing)."""
    with torch.no_grad():
        routing = layer.router(x_TD, True)
        # NOTE: device-to-host sync (setup, untimed)
        totals = torch.tensor([float(routing.num_selected.sum()), float(x_TD.shape[0])], dtype=torch.float64)
    sum_over_ranks(totals, groups, "mean k all_reduce", groups.ep_group)
    return float(totals[0] / totals[1].clamp(min=1))


def calibrate_threshold(
    layer: MoELayer, x_TD: Tensor, groups: ParallelGroups, target_k: float, iterations: int = 40
) -> float:
    """Set every threshold of a top-any router to one shared value g with mean k = target_k.

    A token selects e iff cos(x, W_e) > G_e, so mean k falls monotonically as g rises: bisect g over
    [-1, 1] (the range of a cosine). Every rank sees the same global mean k, so all bisect alike."""
    if layer.config.router != "top_any":
        raise ValueError(f"calibrate_threshold needs a top_any layer, not {layer.config.router!r}")
    lo, hi = -1.0, 1.0
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        _set_thresholds(layer, mid)
        if global_mean_k(layer, x_TD, groups) > target_k:
            lo = mid
        else:
            hi = mid
    # Of the two ends, keep the one whose mean k is closer (k is a step function of g).
    best = min((lo, hi), key=lambda g: abs(_mean_k_at(layer, x_TD, groups, g) - target_k))
    _set_thresholds(layer, best)
    return best


def _set_thresholds(layer: MoELayer, value: float) -> None:
    router = layer.router
    assert isinstance(router, TopAnyRouter), "calibrate_threshold checked that the layer is top_any"
    with torch.no_grad():
        router.threshold.fill_(value)


def _mean_k_at(layer: MoELayer, x_TD: Tensor, groups: ParallelGroups, value: float) -> float:
    _set_thresholds(layer, value)
    return global_mean_k(layer, x_TD, groups)


# -- wire bytes --------------------------------------------------------------------------------------
def fairscale_bytes_per_direction(num_tokens: int, num_experts: int, dim: int, element_size: int) -> int:
    """Bytes one rank sends in one of fairscale's all_to_all calls: the whole E x C x D buffer."""
    return num_experts * fairscale_capacity(num_tokens, num_experts) * dim * element_size


def fairscale_kept_pairs(layer: nn.Module, x_TD: Tensor) -> int:
    """(token, expert) pairs Top2Gate keeps within capacity (the rest of the buffer is zero padding)."""
    with torch.no_grad():
        _, _, dispatch_mask_TEC = cast(nn.Module, layer.gate)(x_TD)  # fairscale's Top2Gate
    return int(dispatch_mask_TEC.sum())  # NOTE: device-to-host sync


# -- the "limit": expert matmuls on the received rows + bare all_to_all calls ------------------------
@dataclass(frozen=True)
class Received:
    """What one rank's dispatcher exchanged in one forward pass of our layer."""

    counts_e: List[int]
    """Rows received per local expert."""
    send_splits: List[int]
    recv_splits: List[int]


def capture_received(layer: MoELayer, x_TD: Tensor) -> Received:
    """Run one forward pass and record the exact split sizes the dispatcher used.

    The dispatcher keeps nothing between calls (by design), so the sizes are caught on their way out
    of ``dispatch`` by a wrapper set on the instance for this one call."""
    seen: Dict[str, List[int]] = {}
    dispatch = layer.dispatcher.dispatch

    def recording(x, routing):
        rows, counts_e, meta = dispatch(x, routing)
        seen.update(
            counts_e=counts_e.tolist(),  # NOTE: device-to-host sync (test probe)
            send=list(meta.send_splits),
            recv=list(meta.recv_splits),
        )
        return rows, counts_e, meta

    # an instance attribute shadowing the method (mypy rejects assigning to a method by name)
    setattr(layer.dispatcher, "dispatch", recording)  # noqa: B010
    try:
        with torch.no_grad():
            layer(x_TD)
    finally:
        del layer.dispatcher.dispatch  # back to the class method
    return Received(seen["counts_e"], seen["send"], seen["recv"])


def expert_matmuls(
    experts: Sequence[nn.Module], counts_e: Sequence[int], dim: int, generator: torch.Generator
) -> Callable[[], None]:
    """A closure running forward + backward of each local expert on exactly its received rows."""
    rows = [torch.randn(n, dim, generator=generator).requires_grad_() for n in counts_e]
    cots = [torch.randn(n, dim, generator=generator) for n in counts_e]

    def run() -> None:
        for expert, x_RD, cot_RD in zip(experts, rows, cots):
            if x_RD.shape[0]:
                (expert(x_RD) * cot_RD).sum().backward()

    return run


def bare_all_to_alls(received: Received, dim: int, group) -> Callable[[], None]:
    """A closure running the four exchanges of one step with no autograd or bookkeeping around them:
    dispatch and combine (forward), and their mirrors (backward)."""
    send_RD = torch.randn(sum(received.send_splits), dim)
    recv_QD = torch.empty(sum(received.recv_splits), dim)
    back_RD = torch.empty_like(send_RD)

    def run() -> None:
        for _ in range(2):  # forward pair, then the backward pair (same sizes, same directions)
            exchange_rows(recv_QD, send_RD, received.recv_splits, received.send_splits, group)
            exchange_rows(back_RD, recv_QD, received.send_splits, received.recv_splits, group)

    return run


def zero_grads(*modules: nn.Module) -> None:
    """Drop gradients between timed steps, so no step pays for accumulating into the previous one's."""
    for module in modules:
        for p in module.parameters():
            p.grad = None
