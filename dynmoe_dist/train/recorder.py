"""Routing observers: per-step counts for telemetry, and window statistics for adaptive experts.

Shape legend: T tokens, E experts of the layer, K bins of the k histogram (k = 0 .. K - 2, and K - 1 or more).
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor

from ..moe.layer import MoELayer
from ..moe.routing import Routing
from ..parallel.groups import ParallelGroups, sum_over_ranks
from ..planning.stats import WindowStats

K_BINS = 9
"""Bins of the per-step k histogram: tokens that chose 0, 1, ..., 7 experts, and 8 or more."""


class LayerRecorder:
    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.window: Optional[WindowStats] = None
        self.reset_step()

    def reset_step(self) -> None:
        # Kept on the layer's device: reading them back per forward would be a host sync per layer.
        device = self.layer.router.weight.device
        self.tokens = 0
        self.k_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.counts_E = torch.zeros(self.layer.num_experts, dtype=torch.float64, device=device)
        self.k_hist_K = torch.zeros(K_BINS, dtype=torch.float64, device=device)

    def start_window(self) -> None:
        cfg = self.layer.config
        assert cfg.max_experts is not None, "MoEConfig fills max_experts in __post_init__"
        self.window = WindowStats.empty(
            self.layer.num_experts, cfg.dim, cfg.max_experts, device=self.layer.router.weight.device
        )

    def __call__(self, layer: MoELayer, x_TD: Tensor, routing: Routing) -> None:
        if not layer.training:
            return
        mask_TE = routing.mask.detach()
        self.tokens += mask_TE.shape[0]
        self.k_sum += routing.num_selected.sum()
        self.counts_E += mask_TE.sum(dim=0)
        # index_add, not bincount: bincount reads the largest value back to size its output (a host sync)
        k_T = routing.num_selected.clamp(max=K_BINS - 1)
        self.k_hist_K.index_add_(0, k_T, torch.ones_like(k_T, dtype=self.k_hist_K.dtype))
        if self.window is not None:
            # The window counts selections before any k = 0 fallback: gates > 0.
            assert routing.probs is not None, "top-any routing carries its gate scores"
            self.window.add_tokens(routing.gates.detach() > 0, routing.probs, x_TD)

    def step_vector(self) -> Tensor:
        head = torch.stack([self.k_sum.new_tensor(float(self.tokens)), self.k_sum])
        return torch.cat([head, self.counts_E, self.k_hist_K]).cpu()  # NOTE: device-to-host sync, once per step


def health(counts: Sequence[float], num_tokens: float) -> Dict[str, object]:
    """One layer's step health from its expert counts: each expert's utilisation (share of the step's tokens
    routed to it) and the load's coefficient of variation (population std / mean over experts; 0 is a
    perfectly even load)."""
    mean = sum(counts) / max(len(counts), 1)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / max(len(counts), 1))
    return {"utilization": [c / max(num_tokens, 1) for c in counts], "load_cv": std / mean if mean > 0 else 0.0}


class Recorders:
    """The recorders of all MoE layers, in layer order: per-step counts, and the adaptive window.

    Stateful for checkpoints: ``state_dict()`` is the window's statistics so far summed over all ranks
    (flat, float64; collective) or None outside a window. Statistics are plain sums, so a resume on any
    world size hands the sum to rank 0 and zeros to the others, and the window's end sums them again.
    """

    def __init__(self, layers: List[MoELayer], groups: ParallelGroups):
        self.recorders = [_attach(layer) for layer in layers]
        self.groups = groups

    def __iter__(self) -> Iterator[LayerRecorder]:
        return iter(self.recorders)

    def __len__(self) -> int:
        return len(self.recorders)

    def __getitem__(self, index: int) -> LayerRecorder:
        return self.recorders[index]

    @property
    def in_window(self) -> bool:
        return any(r.window is not None for r in self.recorders)

    def reset_step(self) -> None:
        for recorder in self.recorders:
            recorder.reset_step()

    def start_window(self) -> None:
        for recorder in self.recorders:
            recorder.start_window()

    def windows(self) -> List[WindowStats]:
        """The open windows, one per layer (call only inside a window)."""
        return [_open(r.window) for r in self.recorders]

    def end_window(self) -> None:
        """After an event: no window, and per-step counts sized for the layers' new expert counts."""
        for recorder in self.recorders:
            recorder.window = None
            recorder.reset_step()

    def step_vector(self) -> Tensor:
        return torch.cat([r.step_vector() for r in self.recorders]) if self.recorders else torch.zeros(0)

    def state_dict(self) -> Dict[str, Optional[Tensor]]:
        """The open window's statistics summed over ranks (every rank calls it: it is an all-reduce)."""
        if not self.recorders or not self.in_window:
            return {"window": None}
        flat = torch.cat([w.to_flat() for w in self.windows()]).cpu()
        return {"window": sum_over_ranks(flat, self.groups, "checkpoint window statistics all_reduce")}

    def load_state_dict(self, state: Dict[str, Optional[Tensor]]) -> None:
        """Restore a window (sized for the layers as they are now); None means outside a window. The sum
        goes to rank 0, the others start from zeros (the window's end sums them again)."""
        self.end_window()
        flat = state.get("window")
        if flat is None:
            return
        if self.groups.rank != 0:
            flat = torch.zeros_like(flat)
        offset = 0
        for recorder in self.recorders:
            recorder.start_window()
            size = _open(recorder.window).to_flat().numel()
            cfg = recorder.layer.config
            recorder.window = WindowStats.from_flat(
                flat[offset : offset + size], recorder.layer.num_experts, cfg.dim
            ).to(recorder.layer.router.weight.device)
            offset += size
        if offset != flat.numel():
            raise ValueError(f"saved window statistics have {flat.numel()} values, the layers need {offset}")


def _open(window: Optional[WindowStats]) -> WindowStats:
    assert window is not None, "no recording window is open"
    return window


def _attach(layer: MoELayer) -> LayerRecorder:
    """One recorder per layer: a second attach replaces the first instead of counting twice."""
    layer.routing_observers[:] = [o for o in layer.routing_observers if not isinstance(o, LayerRecorder)]
    recorder = LayerRecorder(layer)
    layer.routing_observers.append(recorder)
    return recorder
