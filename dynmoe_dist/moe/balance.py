"""Out-of-gradient controllers on what routers choose: a compute budget on top-any thresholds (moe.target_k)
and DeepSeek-V3's auxiliary-loss-free balance (moe.balance = 'bias').

Shape legend: T tokens, E experts of the layer, L MoE layers.

Each training forward, a layer's ``LayerBalance`` (a routing observer) counts on the device what its rules
need: tokens, selections per expert, and (top-any with a budget) the token-expert pairs whose cosine lies
within ``BAND`` of the expert's threshold. Those counts ride in the step's one summed vector (the trainer's
metrics all-reduce, train/loop.py); after it, every rank moves the same tensors by the same amounts,
computed from the same integer sums, so the controllers add no collective and give the same thresholds and
biases on any world size. Nothing here is a parameter of the optimizer's: the moves happen outside the
gradient, after the optimizer's step.

What each rule moves:
- budget (top-any): every threshold G_e of the layer by one common shift, a damped Newton step on the mean k.
  The step's mean k is k(G) = sum_e P(cos_e > G_e); one common shift s changes it by about -S s, where S is
  the density of token-expert cosines at their thresholds, measured as the pairs within +-BAND of them over
  2 BAND tokens and averaged over the steps before (SLOPE_MEMORY; the average is the 'balance' checkpoint
  part). The shift is DAMPING (k - target) / S, at most MAX_SHIFT either way: a measured slope makes the
  rule converge at the same pace whatever the dimension, the expert count or how peaked the cosines are (a
  fixed rate is too slow at one scale and oscillates at another), and the damping (a half step) keeps it
  stable when the slope is misjudged by up to four times and averages the batch's sampling noise. Before
  the shift, the optimizer's common move of the layer's thresholds that step is taken back: the budget owns
  their level, the gradient their differences. k is the experts a token runs (its top-1 fallback
  included): the compute.
- balance 'bias': per expert, rate * sign(mean load - load_e), re-centred to mean zero (torchtitan and
  Megatron re-centre the same way; counts summed over all ranks). A top-k router adds it to its
  ``choice_bias``, a native DeepSeek-V3 router to its ``e_score_correction_bias`` (the checkpoint's,
  updated as DeepSeek trains it); a top-any router subtracts it from its thresholds (a busy expert's
  threshold rises). The moves sum to zero, so the balance never moves a layer's mean threshold: with a
  budget the budget owns the mean k, and its common shift leaves the balance's differences alone.

Why the thresholds G themselves and not an offset buffer beside them: with the straight-through gate a
threshold's value only decides which pairs are chosen (the forward is 0/1; its gradient flows through the
chosen pairs, scaled only by the sigmoid's slope there), so G is already top-any's choice-only bias, and an
offset b would leave the dynamics unchanged (gradient at G + b, the same effective threshold). Moving G
keeps one threshold per expert everywhere it is read: the dense checkpoint saves it (no second copy to keep
in step), a converted model's calibration sets it, an export writes it, adaptive events slice it. Routers
are outside FSDP (parallel/fsdp.py), so every rank holds the whole tensor and applies the same move.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .config import MoEConfig
from .layer import MoELayer, NativeRouter, SoftmaxRouter, TopAnyRouter
from .routing import Routing

BAND = 0.01
"""Half-width, in cosine units, of the band around each threshold whose pairs measure the slope of k."""
DAMPING = 0.5
"""Fraction of the Newton step the budget takes."""
MAX_SHIFT = 0.05
"""Largest common threshold shift of one step (cosines lie in [-1, 1])."""
SLOPE_MEMORY = 0.7
"""Weight of the earlier steps in the slope the budget divides by (an exponential average)."""


def measured_slope(near_per_token: float) -> float:
    """How fast the mean k falls per unit of common threshold shift: the pairs within BAND of their thresholds
    per token, over the band's width."""
    return near_per_token / (2 * BAND)


def budget_shift(mean_k: float, target_k: float, slope: float) -> float:
    """The common threshold shift of one step: a damped Newton step on mean k, with the slope of k in the
    shift (``measured_slope``, smoothed over the steps before)."""
    error = mean_k - target_k
    if slope <= 0:  # no pair near any threshold: the slope is unknown, move the most a step may
        return math.copysign(MAX_SHIFT, error) if error else 0.0
    return max(-MAX_SHIFT, min(MAX_SHIFT, DAMPING * error / slope))


def balance_moves(counts_E: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's update of a choice bias: rate * sign(mean load - load_e), re-centred to mean zero
    (float64). An expert above the mean load gets a lower bias, one below it a higher one."""
    counts_E = counts_E.double()
    moves_E = rate * torch.sign(counts_E.mean() - counts_E)
    return moves_E - moves_E.mean()


def choice_bias(router: torch.nn.Module) -> Optional[Tensor]:
    """The per-expert bias a router adds to its scores for choosing only: a top-k router's ``choice_bias``,
    a native router's correction bias (DeepSeek-V3); None for a router with neither."""
    if isinstance(router, SoftmaxRouter):
        return router.choice_bias
    if isinstance(router, NativeRouter):
        return router.e_score_correction_bias
    return None


class LayerBalance:
    """One layer's controllers: a routing observer that counts the step's selections on the device, and the
    update that moves the layer's thresholds or choice bias from the counts summed over every rank."""

    def __init__(self, layer: MoELayer, config: MoEConfig):
        self.layer = layer
        self.target_k = config.target_k if isinstance(layer.router, TopAnyRouter) else 0.0
        self.rate = config.balance_rate if config.balance == "bias" else 0.0
        self.slope: Optional[float] = None
        """The budget's slope of k, averaged over the steps so far (None before the first): checkpointed."""
        self.started_E: Optional[Tensor] = None
        self.start_step()

    def start_step(self) -> None:
        """Zero the step's counts, sized for the layer's experts now (events resize layers between steps), and
        with a budget note the thresholds the step starts from (see ``_move_thresholds``)."""
        router = self.layer.router
        self.counts = torch.zeros(2 + self.layer.num_experts, dtype=torch.float64, device=router.weight.device)
        self.started_E = self._thresholds().detach().clone() if self.target_k else None

    def _thresholds(self) -> Tensor:
        router = self.layer.router
        assert isinstance(router, TopAnyRouter), "only a top-any layer has a budget"
        return router.threshold

    def __call__(self, layer: MoELayer, x_TD: Tensor, routing: Routing) -> None:
        if not layer.training:
            return
        mask_TE = routing.mask.detach()
        self.counts[0] += mask_TE.shape[0]
        self.counts[2:] += mask_TE.sum(dim=0)
        if self.target_k:
            self.counts[1] += self._near_pairs(routing)

    def _near_pairs(self, routing: Routing) -> Tensor:
        """Token-expert pairs whose cosine lies within BAND of the expert's threshold (top-any's probs are
        sigmoid(cos), so logit(probs) is the cosine)."""
        assert routing.probs is not None, "top-any routing carries its gate scores"
        threshold_E = self._thresholds().detach().to(routing.probs.dtype)
        return ((routing.probs.detach().logit() - threshold_E).abs() < BAND).sum()

    @property
    def size(self) -> int:
        return self.counts.numel()

    @torch.no_grad()
    def update(self, summed: Sequence[float]) -> Dict[str, float]:
        """Move the layer's thresholds / choice bias from its counts summed over all ranks (plain floats,
        equal on every rank); returns what it did, for the step record."""
        tokens, near, counts_E = summed[0], summed[1], torch.tensor(summed[2:], dtype=torch.float64)
        if tokens <= 0:
            return {}
        moves_E = balance_moves(counts_E, self.rate) if self.rate else counts_E.new_zeros(counts_E.shape)
        router = self.layer.router
        if isinstance(router, TopAnyRouter):
            return self._move_thresholds(router.threshold, moves_E, float(counts_E.sum()) / tokens, near / tokens)
        bias = choice_bias(router)
        assert bias is not None, "MoEConfig and the routers refuse balance 'bias' without a choice bias"
        bias.add_(moves_E.to(bias))
        return {"bias_spread": float(bias.max() - bias.min())}

    def _slope_before(self, slope_now: float) -> float:
        """The slope the step divides by: the average of the steps before this one, not this step's own
        measurement. This step's tokens set both its k and its slope (a batch richer in high cosines has more
        pairs near the thresholds too), so dividing by its own slope would damp the steps above the target
        more than those below and hold k a few percent high on average."""
        before = slope_now if self.slope is None else self.slope
        self.slope = slope_now if self.slope is None else SLOPE_MEMORY * self.slope + (1 - SLOPE_MEMORY) * slope_now
        return before

    def _move_thresholds(self, threshold_E: Tensor, moves_E: Tensor, mean_k: float, near: float) -> Dict[str, float]:
        """With a budget, the optimizer's common move of the layer's thresholds this step is taken back first:
        the budget owns their level, the gradient shapes their differences. A gradient that pushes the level
        the same way every step (the task loss asking for more experts) is a ramp an integrating controller
        follows only a step behind, with an error of push / DAMPING (5 % of k in a small run); taken back at
        the source, it leaves the budget nothing but the slow drift of the gate vectors and the tokens."""
        shift = 0.0
        if self.target_k:
            assert self.started_E is not None, "start_step notes the thresholds when there is a budget"
            threshold_E.sub_((threshold_E - self.started_E).mean())
            shift = budget_shift(mean_k, self.target_k, self._slope_before(measured_slope(near)))
        # a balance move is a choice-bias move: a busy expert (negative move) gets a higher threshold
        threshold_E.add_((shift - moves_E).to(threshold_E))
        return {"threshold_shift": shift} if self.target_k else {}


class Balancers:
    """The controllers of every MoE layer, in layer order (build with ``for_layers``). Stateful: a checkpoint
    part of its own ('balance')."""

    def __init__(self, layers: List[MoELayer], config: MoEConfig):
        self.layers = [_attach(LayerBalance(layer, config)) for layer in layers]

    @staticmethod
    def for_layers(layers: List[MoELayer], config: MoEConfig) -> Optional["Balancers"]:
        """The run's controllers, or None when neither a budget nor the bias rule is on."""
        on = (config.target_k and config.router == "top_any") or config.balance == "bias"
        return Balancers(layers, config) if on and layers else None

    def start_step(self) -> None:
        for balance in self.layers:
            balance.start_step()

    def step_vector(self) -> Tensor:
        """Every layer's counts, one flat float64 vector for the step's all-reduce."""
        return torch.cat([b.counts for b in self.layers]).cpu()  # NOTE: device-to-host sync, once per step

    @property
    def size(self) -> int:
        return sum(b.size for b in self.layers)

    def state_dict(self) -> Dict[str, List[Optional[float]]]:
        """The budget's averaged slopes (equal on every rank). The thresholds and choice biases they move are
        the routers' own tensors, saved with the dense state."""
        return {"slopes": [b.slope for b in self.layers]}

    def load_state_dict(self, state: Dict[str, List[Optional[float]]]) -> None:
        slopes = state["slopes"]
        if len(slopes) != len(self.layers):
            raise ValueError(f"saved balance state has {len(slopes)} layers, the model has {len(self.layers)}")
        for balance, slope in zip(self.layers, slopes):
            balance.slope = slope

    def update(self, summed: Sequence[float]) -> Dict[str, List[float]]:
        """Apply every layer's update from its slice of the summed vector; per-layer lists for the record."""
        per_layer: Dict[str, List[float]] = {}
        offset = 0
        for balance in self.layers:
            done = balance.update(summed[offset : offset + balance.size])
            offset += balance.size
            for key, value in done.items():
                per_layer.setdefault(key, []).append(value)
        assert offset == len(summed), "the summed vector is this object's step_vector, summed"
        return per_layer


def _attach(balance: LayerBalance) -> LayerBalance:
    """One controller per layer: a second attach replaces the first instead of counting twice."""
    observers = balance.layer.routing_observers
    observers[:] = [o for o in observers if not isinstance(o, LayerBalance)]
    observers.append(balance)
    return balance
