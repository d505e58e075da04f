"""AdamW with the usual exclusions from weight decay, a warm-up + cosine schedule, and the param-group
refresh that expert add/remove/move needs.

No decay for: 1-D parameters (norms, biases, thresholds) and router gate vectors (their direction
is what routing reads; decay would only shrink them, and the simple loss already regularises them).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from ..parallel.fsdp import shard_like


def decays(name: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2 and "router." not in f".{name}"


def split_params(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    decay: List[nn.Parameter] = []
    no_decay: List[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return decay, no_decay


def build_optimizer(model: nn.Module, train_config) -> torch.optim.AdamW:
    decay, no_decay = split_params(model)
    groups = [
        {"params": decay, "weight_decay": train_config.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    # foreach=False: the per-parameter loop updates each tensor in the same order whatever the
    # world size, which keeps float64 runs bitwise reproducible across placements.
    return torch.optim.AdamW(groups, lr=train_config.lr, betas=tuple(train_config.betas), foreach=False)


def refresh_param_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Point the param groups at the model's current parameters; drop state of parameters that left.

    Parameters that stay keep their state (it is keyed by the tensor object); new ones start fresh.
    """
    decay, no_decay = split_params(model)
    by_name: Dict[str, List] = {"decay": decay, "no_decay": no_decay}
    for group in optimizer.param_groups:
        group["params"] = by_name[group["name"]]
    alive = {id(p) for p in decay + no_decay}
    for p in [p for p in optimizer.state if id(p) not in alive]:
        del optimizer.state[p]


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, train_config, total_steps: int) -> float:
    """Set the learning rate for optimizer step `step` (a pure function of the step: resumable)."""
    lr = train_config.lr * lr_lambda(step, train_config.warmup_steps, total_steps, train_config.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _on_device(state: Dict, device) -> Dict:
    # Adam keeps `step` on the CPU (capturable=False); moments live with their parameter.
    return {k: v.to(device) if torch.is_tensor(v) and k != "step" else v for k, v in state.items()}


class ExpertOptimizerState:
    """The experts' optimizer state keyed by *logical* names, for checkpoints: positions in the optimizer
    change whenever experts are added, removed or moved, names do not. (The dense state goes through
    DCP as it is held: train/dense_state.py.)

    ``{"layer/expert": {param name: state}}``; experts are saved by their owner only and restored on every
    rank that holds them (a saved moment is a full logical tensor, cut like its parameter on load).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owned_experts: Dict, local_experts: Dict):
        self.optimizer = optimizer
        self.owned_experts = owned_experts
        self.local_experts = local_experts

    def owned_state(self) -> Dict:
        """The owned experts' state as the optimizer holds it (no copies; a sharded expert's moments are
        its shards' DTensors): a checkpoint streams it to disk tensor by tensor."""
        state = self.optimizer.state
        return {
            key: {name: dict(state[p]) for name, p in params.items() if p in state}
            for key, params in self.owned_experts.items()
        }

    def load_state_dict(self, saved: Dict) -> None:
        for key, params in self.local_experts.items():
            self._load(params, saved.get(key, {}))

    def _load(self, named: Dict, saved: Dict) -> None:
        for name, state in saved.items():
            if name in named:
                p = named[name]
                self.optimizer.state[p] = {
                    k: shard_like(v, p) if k != "step" else v for k, v in _on_device(state, p.device).items()
                }
