"""Routing observers: per-step counts for telemetry, and window statistics for adaptive experts.

Shape legend: T tokens, E experts of the layer.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ..moe.layer import MoELayer
from ..moe.routing import Routing
from ..planning.stats import WindowStats


class LayerRecorder:
    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.window: Optional[WindowStats] = None
        self.reset_step()

    def reset_step(self) -> None:
        self.tokens = 0.0
        self.k_sum = 0.0
        self.counts_E = torch.zeros(self.layer.num_experts, dtype=torch.float64)

    def start_window(self) -> None:
        cfg = self.layer.config
        self.window = WindowStats.empty(self.layer.num_experts, cfg.dim, cfg.max_experts)

    def __call__(self, layer: MoELayer, x_TD: Tensor, routing: Routing) -> None:
        if not layer.training:
            return
        mask_TE = routing.mask.detach()
        self.tokens += mask_TE.shape[0]
        self.k_sum += float(routing.num_selected.sum())  # NOTE: device-to-host sync
        self.counts_E += mask_TE.sum(dim=0).double().cpu()
        if self.window is not None:
            # The window counts selections before any k = 0 fallback: gates > 0.
            self.window.add_tokens(routing.gates.detach() > 0, routing.probs, x_TD)

    def step_vector(self) -> Tensor:
        return torch.cat([torch.tensor([self.tokens, self.k_sum], dtype=torch.float64), self.counts_E])


def attach_recorders(layers: List[MoELayer]) -> List[LayerRecorder]:
    recorders = []
    for layer in layers:
        layer.routing_observers[:] = [o for o in layer.routing_observers if not isinstance(o, LayerRecorder)]
        recorder = LayerRecorder(layer)
        layer.routing_observers.append(recorder)
        recorders.append(recorder)
    return recorders
