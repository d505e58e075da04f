"""Dropless expert-parallel dispatch: one variable-size all-to-all each way, no capacity padding.

Shape legend: T local tokens, D model dim, E logical experts, S global slots (all replicas of all
experts, rank-major), e local slots, R routed pairs sent by this rank, Q rows received by this rank,
W ep group size.

dispatch (sender side): routed pairs (expert-major) -> each pair picks a replica of its expert (a
deterministic contiguous split of that expert's rows) -> stable sort by global slot, so the rows for
each destination rank are contiguous and within it ordered by local slot -> exchange per-slot counts
-> all_to_all_single of exactly the routed rows.
Receiver side: rows arrive grouped by source rank, then slot; a stable sort by local slot makes them
expert-contiguous for the grouped matmul. combine is the mirror image, then the weighted index-add.

Nothing is stored on the dispatcher between dispatch and combine: everything combine needs travels in
the frozen ``A2AMeta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..moe.experts import autocast_rows
from ..moe.permute import (
    combine_rows,
    inverse_permutation,
    replica_index,
    replica_row_counts,
    routed_pairs,
    sort_by_slot,
)
from ..moe.routing import Routing
from .groups import ParallelGroups, named
from .shard import SlotTables


def exchange_rows(out_QD: Tensor, x_RD: Tensor, out_splits: List[int], in_splits: List[int], group: Any) -> Tensor:
    """The bare variable-size exchange (no autograd, no bookkeeping); benchmarks time it alone."""
    dist.all_to_all_single(out_QD, x_RD.contiguous(), out_splits, in_splits, group=group)
    return out_QD


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with explicit split sizes; backward is the same exchange reversed."""

    @staticmethod
    def forward(
        ctx: Any,
        x_RD: Tensor,
        out_splits: List[int],
        in_splits: List[int],
        group: Any,
        what: str,
        groups: ParallelGroups,
    ) -> Tensor:
        ctx.splits, ctx.group, ctx.what, ctx.groups = (out_splits, in_splits), group, what, groups
        out_QD = x_RD.new_empty((sum(out_splits),) + tuple(x_RD.shape[1:]))
        with named(what, groups):
            exchange_rows(out_QD, x_RD, out_splits, in_splits, group)
        return out_QD

    @staticmethod
    def backward(ctx: Any, grad_QD: Tensor) -> Tuple[Optional[Tensor], ...]:
        out_splits, in_splits = ctx.splits
        grad_RD = grad_QD.new_empty((sum(in_splits),) + tuple(grad_QD.shape[1:]))
        with named(f"{ctx.what} (backward)", ctx.groups):
            exchange_rows(grad_RD, grad_QD, in_splits, out_splits, ctx.group)
        return grad_RD, None, None, None, None, None


def all_to_all(x: Tensor, out_splits: List[int], in_splits: List[int], groups: ParallelGroups, what: str) -> Tensor:
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, groups.ep_group, what, groups)  # type: ignore[no-untyped-call]
    return out


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group. Backward sums the gradients too: every rank's output depends on every input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, what: str, groups: ParallelGroups) -> Tensor:
        ctx.group, ctx.what, ctx.groups = group, what, groups
        out = x.clone()
        with named(what, groups):
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        grad = grad.clone()
        with named(f"{ctx.what} (backward)", ctx.groups):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None, None


class AllReduceReducer:
    """Aux-loss token statistics summed over every rank (all ranks are data ranks).

    Each rank then holds the loss of the global batch; ``loss_scale = 1/world`` makes the sum of the
    per-rank losses (what gradient summation computes) equal that loss exactly once.
    """

    def __init__(self, groups: ParallelGroups):
        self.groups = groups
        self.loss_scale = 1.0 / groups.world_size

    def sum(self, t: Tensor) -> Tensor:
        out: Tensor = _AllReduceSum.apply(
            t,
            None,
            "moe aux-loss statistics all_reduce",  # type: ignore[no-untyped-call]
            self.groups,
        )
        return out


@dataclass
class CommCounter:
    """Cumulative traffic of one dispatcher (forward exchanges), read by benchmarks and telemetry."""

    rows_sent: int = 0
    bytes_sent: int = 0
    remote_bytes_sent: int = 0
    rows_received: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.rows_sent = self.bytes_sent = self.remote_bytes_sent = self.rows_received = self.calls = 0


@dataclass(frozen=True)
class A2AMeta:
    token_R: Tensor
    """Source token of each sent row, in send order."""
    weight_R: Tensor
    """Combine weight of each sent row (carries the router gradient)."""
    send_splits: List[int]
    recv_splits: List[int]
    local_order_Q: Tensor
    """Received row i of the expert-contiguous layout was row local_order_Q[i] of the wire layout."""
    num_tokens: int
    sizes_e: Optional[Tuple[int, ...]] = None
    """Rows received per local slot as Python ints (from the split-size read)."""


class AllToAllDispatcher:
    """Expert-parallel dispatcher over the ep group of ``groups``. It holds the slot tables of its
    layer's current placement (built by the layer's ``LayerShard``), never the placement itself."""

    def __init__(self, groups: ParallelGroups, tables: SlotTables, name: str = "moe"):
        self.groups = groups
        self.name = name
        self.comm = CommCounter()
        self.set_tables(tables)

    def set_tables(self, tables: SlotTables) -> None:
        if tables.ep_size != self.groups.ep_size:
            raise ValueError(f"placement ep_size ({tables.ep_size}) != group ep_size ({self.groups.ep_size})")
        self.tables = tables

    def dispatch(self, x_TD: Tensor, routing: Routing) -> Tuple[Tensor, Tensor, A2AMeta]:
        t = self.tables
        # Per-slot counts follow from the expert counts alone, so the count exchange runs before any
        # host read, and one read brings every size: expert counts, send and receive splits.
        counts_E = routing.mask.sum(dim=0)
        counts_S = self._slot_counts(counts_E)
        recv_counts_We = self._exchange_counts(counts_S)
        send_W = counts_S.new_zeros(self.groups.ep_size).index_add_(0, t.rank_of_slot_S, counts_S)
        # NOTE: device-to-host sync (split sizes must be Python ints for all_to_all_single): the one
        # read of this layer forward; routed_pairs and the expert loop reuse it.
        W, E, e = self.groups.ep_size, counts_E.shape[0], recv_counts_We.shape[1]
        sizes = torch.cat([counts_E, send_W, recv_counts_We.reshape(-1)]).tolist()
        send_splits = sizes[E : E + W]
        recv_We = [sizes[E + W + i * e : E + W + (i + 1) * e] for i in range(W)]
        recv_splits = [sum(row) for row in recv_We]
        pairs = routed_pairs(routing, counts_E, tuple(sizes[:E]))
        replica_R = replica_index(pairs.counts_E, pairs.expert_R, t.num_replicas_E)
        slot_R = t.slot_ER[pairs.expert_R, replica_R]
        order_R, _ = sort_by_slot(slot_R, t.num_slots)
        token_R = pairs.token_R[order_R]
        rows_RD = autocast_rows(x_TD).index_select(0, token_R)
        recv_QD = all_to_all(
            ensure_grad(rows_RD), recv_splits, send_splits, self.groups, f"{self.name} dispatch all_to_all_single"
        )
        local_order_Q, counts_e = _expert_contiguous_order(recv_counts_We, sum(recv_splits))
        self._count(rows_RD, send_splits, recv_splits)
        meta = A2AMeta(
            token_R,
            pairs.weight_R[order_R],
            send_splits,
            recv_splits,
            local_order_Q,
            x_TD.shape[0],
            tuple(sum(column) for column in zip(*recv_We)),
        )
        return recv_QD.index_select(0, local_order_Q), counts_e, meta

    def combine(self, rows_QD: Tensor, meta: A2AMeta) -> Tensor:
        wire_QD = rows_QD.index_select(0, inverse_permutation(meta.local_order_Q))
        back_RD = all_to_all(
            ensure_grad(wire_QD),
            meta.send_splits,
            meta.recv_splits,
            self.groups,
            f"{self.name} combine all_to_all_single",
        )
        return combine_rows(back_RD, meta.token_R, meta.weight_R, meta.num_tokens)

    def _slot_counts(self, counts_E: Tensor) -> Tensor:
        """Rows this rank sends to each global slot (what sort_by_slot would count), from the counts."""
        t = self.tables
        per_replica_ER = replica_row_counts(counts_E, t.num_replicas_E, t.slot_ER.shape[1])
        # Padding entries (slot -1) carry 0 rows: add them to slot 0 instead of masking (no host read).
        return counts_E.new_zeros(t.num_slots).index_add_(
            0, t.slot_ER.clamp(min=0).reshape(-1), per_replica_ER.reshape(-1)
        )

    def _exchange_counts(self, counts_S: Tensor) -> Tensor:
        """Send each rank the row counts of its own slots; returns (W, e) counts received."""
        W, mine = self.groups.ep_size, self.tables.slots_per_rank[self.groups.ep_rank]
        recv = counts_S.new_empty(W * mine)
        with named(f"{self.name} count exchange all_to_all_single", self.groups):
            dist.all_to_all_single(recv, counts_S, [mine] * W, self.tables.slots_per_rank, group=self.groups.ep_group)
        return recv.view(W, mine)

    def _count(self, rows_RD: Tensor, send_splits: List[int], recv_splits: List[int]) -> None:
        row_bytes = rows_RD.shape[1] * rows_RD.element_size()
        me = self.groups.ep_rank
        self.comm.rows_sent += rows_RD.shape[0]
        self.comm.bytes_sent += rows_RD.shape[0] * row_bytes
        self.comm.remote_bytes_sent += (rows_RD.shape[0] - send_splits[me]) * row_bytes
        self.comm.rows_received += sum(recv_splits)
        self.comm.calls += 1


def _expert_contiguous_order(recv_counts_We: Tensor, num_received: int) -> Tuple[Tensor, Tensor]:
    """Rows arrive source-major (then slot); return the stable order that makes them slot-major.
    ``num_received`` (already read with the split sizes) spares repeat_interleave a host sync."""
    W, e = recv_counts_We.shape
    slot_of_block = torch.arange(e, device=recv_counts_We.device).repeat(W)
    slot_Q = torch.repeat_interleave(slot_of_block, recv_counts_We.reshape(-1), output_size=num_received)
    order_Q, counts_e = sort_by_slot(slot_Q, e)
    return order_Q, counts_e


def ensure_grad(rows: Tensor) -> Tensor:
    """Every rank must take part in the backward exchange, even one that sends or receives nothing
    or whose input needs no gradient: give the exchange an input that requires grad."""
    if torch.is_grad_enabled() and not rows.requires_grad:
        return rows.detach().requires_grad_()
    return rows
