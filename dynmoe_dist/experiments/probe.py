"""A routing observer for what the step records lack: tokens routed to no expert, and k at evaluation.

DynMoE's top-any router may select no expert for a token (k = 0): in training such a token skips the
MoE layer (rides the residual), at evaluation it falls back to its top-1 expert. The step records'
``mean_k`` counts those tokens as 0, so a mean k below 1 cannot be read without the k = 0 share; and
the k the model uses at inference (fallback included) is recorded nowhere. This probe counts both.

Shape legend: T tokens, E experts, L MoE layers. Counts stay on the layer's device (no sync per call).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..moe.layer import find_moe_layers

# Columns of the per-layer count rows.
FIELDS = (
    "train_tokens",
    "train_k0",
    "recent_train_tokens",
    "recent_train_k0",
    "eval_tokens",
    "eval_k_sum",
    "eval_fallback",
)
RECENT_TRAIN = ("recent_train_tokens", "recent_train_k0")
EVAL = ("eval_tokens", "eval_k_sum", "eval_fallback")


def _columns(*names: str) -> List[int]:
    return [FIELDS.index(name) for name in names]


class RoutingProbe:
    """Attach with ``RoutingProbe.attach(model)``; ``totals()`` gives the counts (plain lists, summable
    over ranks). "recent" training counts restart at the first training step after an evaluation, and
    evaluation counts restart at the first evaluation after training: with an evaluation at every epoch
    end they end up describing the last epoch and the final evaluation."""

    def __init__(self, num_layers: int):
        self.counts_LF: Optional[torch.Tensor] = None
        self.num_layers = num_layers
        self.last_mode: List[Optional[str]] = [None] * num_layers

    @classmethod
    def attach(cls, model: torch.nn.Module) -> "RoutingProbe":
        layers = [layer for _, layer in find_moe_layers(model)]
        probe = cls(len(layers))
        for index, layer in enumerate(layers):
            layer.routing_observers.append(_LayerHook(probe, index))
        return probe

    def observe(self, index: int, training: bool, routing) -> None:
        selected_T = (routing.gates.detach() > 0).sum(dim=-1)  # before any k = 0 fallback
        if self.counts_LF is None:
            self.counts_LF = torch.zeros(self.num_layers, len(FIELDS), dtype=torch.float64, device=selected_T.device)
        row = self.counts_LF[index]
        mode = "train" if training else "eval"
        if self.last_mode[index] != mode:
            row[_columns(*(RECENT_TRAIN if training else EVAL))] = 0.0
            self.last_mode[index] = mode
        num_tokens, num_k0 = float(selected_T.numel()), (selected_T == 0).sum()
        if training:
            row[_columns("train_tokens", "recent_train_tokens")] += num_tokens
            row[_columns("train_k0", "recent_train_k0")] += num_k0
        else:
            row[_columns("eval_tokens")] += num_tokens
            row[_columns("eval_k_sum")] += routing.num_selected.sum()  # after the fallback: what inference computes
            row[_columns("eval_fallback")] += num_k0

    def totals(self) -> Dict[str, List[float]]:
        """Field -> per-layer counts. NOTE: device-to-host sync (once, at the end of a run)."""
        counts = self.counts_LF.cpu() if self.counts_LF is not None else torch.zeros(self.num_layers, len(FIELDS))
        return {name: counts[:, i].tolist() for i, name in enumerate(FIELDS)}


class _LayerHook:
    def __init__(self, probe: RoutingProbe, index: int):
        self.probe, self.index = probe, index

    def __call__(self, layer, x_TD, routing) -> None:
        self.probe.observe(self.index, layer.training, routing)


def add_totals(per_rank: List[Dict[str, List[float]]]) -> Dict[str, List[float]]:
    """Counts of several ranks summed (every rank routes its own share of each batch)."""
    return {name: [sum(values) for values in zip(*(t[name] for t in per_rank))] for name in per_rank[0]}


def routing_summary(totals: Dict[str, List[float]]) -> Dict[str, float]:
    """Shares over all MoE layers: k = 0 in all training and in the last epoch, mean k and fallback share
    at the final evaluation."""

    def ratio(num: str, den: str) -> float:
        den_total = sum(totals[den])
        return sum(totals[num]) / den_total if den_total else float("nan")

    return {
        "train_k0_share": ratio("train_k0", "train_tokens"),
        "last_epoch_k0_share": ratio("recent_train_k0", "recent_train_tokens"),
        "eval_k": ratio("eval_k_sum", "eval_tokens"),
        "eval_fallback_share": ratio("eval_fallback", "eval_tokens"),
    }
