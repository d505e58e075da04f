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
        # Kept on the layer's device: reading them back per forward would be a host sync per layer.
        device = self.layer.router.weight.device
        self.tokens = 0
        self.k_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.counts_E = torch.zeros(self.layer.num_experts, dtype=torch.float64, device=device)

    def start_window(self) -> None:
        cfg = self.layer.config
        self.window = WindowStats.empty(self.layer.num_experts, cfg.dim, cfg.max_experts,
                                        device=self.layer.router.weight.device)

    def __call__(self, layer: MoELayer, x_TD: Tensor, routing: Routing) -> None:
        if not layer.training:
            return
        mask_TE = routing.mask.detach()
        self.tokens += mask_TE.shape[0]
        self.k_sum += routing.num_selected.sum()
        self.counts_E += mask_TE.sum(dim=0)
        if self.window is not None:
            # The window counts selections before any k = 0 fallback: gates > 0.
            self.window.add_tokens(routing.gates.detach() > 0, routing.probs, x_TD)

    def step_vector(self) -> Tensor:
        head = torch.stack([self.k_sum.new_tensor(float(self.tokens)), self.k_sum])
        return torch.cat([head, self.counts_E]).cpu()  # NOTE: device-to-host sync, once per step


def attach_recorders(layers: List[MoELayer]) -> List[LayerRecorder]:
    recorders = []
    for layer in layers:
        layer.routing_observers[:] = [o for o in layer.routing_observers if not isinstance(o, LayerRecorder)]
        recorder = LayerRecorder(layer)
        layer.routing_observers.append(recorder)
        recorders.append(recorder)
    return recorders
