"""What a family's sparse block adds around its routed experts, by kind: the module an import puts in the
block's place (``MoEFamily.block`` names the kind). The exported remote code (remote/dynmoe_layers.py
BLOCKS) builds the same kinds under the same names, since an export must load without dynmoe_dist.

Shape legend: B batch, L sequence length, D model dim.

  routed          the routed experts only (the default: Mixtral's kind)
  shared_expert   + sigmoid(shared_expert_gate(x)) * shared_expert(x) (Qwen2-MoE's kind)
  shared_experts  + shared_experts(x), always on (DeepSeek-V3's kind)
  router_scores   the (hidden, router scores) pair its decoder layer unpacks (gpt-oss's kind)

Each family's module names its kind (``block_kind``).

The shared experts stay the checkpoint's own modules under their own names, so their keys map to themselves.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ....moe.layer import MoELayer
from ..upcycle import MoEBlock


class SharedExpertBlock(MoEBlock):
    """Routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x), both the checkpoint's modules."""

    def __init__(self, moe: MoELayer, shared_expert: nn.Module, shared_expert_gate: nn.Module):
        super().__init__(moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x_BLD: Tensor) -> Tensor:
        routed_BLD = self.run(x_BLD).output
        return routed_BLD + torch.sigmoid(self.shared_expert_gate(x_BLD)) * self.shared_expert(x_BLD)


class SharedExpertsBlock(MoEBlock):
    """Routed experts + the always-on shared experts (one MLP n_shared_experts wide)."""

    def __init__(self, moe: MoELayer, shared_experts: nn.Module):
        super().__init__(moe)
        self.shared_experts = shared_experts

    def forward(self, x_BLD: Tensor) -> Tensor:
        return self.run(x_BLD).output + self.shared_experts(x_BLD)


class RouterScoresBlock(MoEBlock):
    """Its MLP returns (hidden, router scores) and the decoder layer drops the scores; the combine weights
    (T, E) stand in for them."""

    def forward(self, x_BLD: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        out = self.run(x_BLD)
        return out.output, out.routing.weights


# kind -> (converted MoE layer, the stock sparse block it replaces) -> the block in its place
BLOCKS: Dict[str, Callable[[MoELayer, nn.Module], MoEBlock]] = {
    "routed": lambda layer, mlp: MoEBlock(layer),
    "shared_expert": lambda layer, mlp: SharedExpertBlock(
        layer, mlp.get_submodule("shared_expert"), mlp.get_submodule("shared_expert_gate")
    ),
    "shared_experts": lambda layer, mlp: SharedExpertsBlock(layer, mlp.get_submodule("shared_experts")),
    "router_scores": lambda layer, mlp: RouterScoresBlock(layer),
}
