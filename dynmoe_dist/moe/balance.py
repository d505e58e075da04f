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
  part). The shift is DAMPING (k - target) / S plus the layer's drift, at most MAX_SHIFT either way: a
  measured slope makes the rule converge at the same pace whatever the dimension, the expert count or how
  peaked the cosines are (a fixed rate is too slow at one scale and oscillates at another). The drift is the
  integral term, DRIFT_GAIN (k - target) / S summed over the steps: the common move the thresholds have
  needed every step lately. Without it the rule follows a steady fall of k (the gate vectors and hidden
  states drift while the finetune trains; k fell nearly every step of the frontier's runs at peak lr) a step
  behind, with a standing error of fall / DAMPING, and a sudden drop (k 11 % lower from one step to the next
  in one layer) took 4-5 steps to recover: 10-step windows 4-5.6 % off target 1.0. With the drift and
  DAMPING 0.8 (0.5 before) the same run's worst window is 2.1 %. The loop's poles (z^2 - (2 - P - I) z + 1 - P,
  P = DAMPING c, I = DRIFT_GAIN c, with c the true slope over the measured one) stay inside the unit circle
  for c up to 2.35; the measured slope errs high if anything (the sudden drop recovered as if c were 0.5).
  The drift integrates only errors within DRIFT_BAND of the target, so the way down from an uncalibrated
  start does not wind it up. Before the shift, the optimizer's common move of the layer's thresholds that
  step is taken back: the budget owns their level, the gradient their differences. k is the experts a token
  runs (its top-1 fallback included): the compute.
- budget, an expert an adaptive event adds (``start_added_experts``): the event gives it threshold UNSET,
  above every cosine, so it chooses nothing in its first step; that step counts its cosines in BIN-wide
  bins, and after it the budget sets its threshold where it takes its share of the budget (target_k / E of
  the tokens), and counts that share in the step's k, so the common shift makes room for it. The event's
  usual threshold 0 would not do: an added gate vector is the mean of the unrouted hidden states, which lie
  on one side of it, so nearly every token chose it (k from 1.0 to 2.0 in the quick start at target_k 1),
  and the common shift that brought k back starved every other expert of the layer.
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
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .config import MoEConfig
from .layer import MoELayer, NativeRouter, SoftmaxRouter, TopAnyRouter
from .routing import Routing

BAND = 0.01
"""Half-width, in cosine units, of the band around each threshold whose pairs measure the slope of k."""
DAMPING = 0.8
"""Fraction of the Newton step the budget takes."""
DRIFT_GAIN = 0.1
"""Fraction of the Newton step added to the budget's drift each step (the integral term's gain)."""
DRIFT_BAND = 0.25
"""The drift integrates only errors within this fraction of the target: a fall or a drop, not the way down
from an uncalibrated start (k 3.5 against target 1.25 wound it up: k 8 % under the target for 10 steps)."""
MAX_SHIFT = 0.05
"""Largest common threshold shift of one step (cosines lie in [-1, 1])."""
SLOPE_MEMORY = 0.7
"""Weight of the earlier steps in the slope the budget divides by (an exponential average)."""
UNSET = 2.0
"""Threshold of an expert an event added to a layer with a budget, until the budget sets it: above every
cosine (cosines lie in [-1, 1]), so the expert chooses nothing."""
BIN = 0.01
"""Width of the cosine bins an unset expert's first step is counted in (its threshold's resolution)."""
NUM_BINS = round(2 / BIN)


def measured_slope(near_per_token: float) -> float:
    """How fast the mean k falls per unit of common threshold shift: the pairs within BAND of their thresholds
    per token, over the band's width."""
    return near_per_token / (2 * BAND)


def budget_shift(mean_k: float, target_k: float, slope: float, drift: float = 0.0) -> Tuple[float, float]:
    """The common threshold shift of one step and the drift after it: a damped Newton step on mean k (the
    slope of k in the shift from ``measured_slope``, smoothed over the steps before) plus the drift, which
    integrates the error. While the shift is at MAX_SHIFT the drift stays where it was (no wind-up during a
    large correction, such as the first steps of an uncalibrated run)."""
    error = mean_k - target_k
    if slope <= 0:  # no pair near any threshold: the slope is unknown, move the most a step may
        return (math.copysign(MAX_SHIFT, error) if error else 0.0), drift
    gain = DRIFT_GAIN if abs(error) <= DRIFT_BAND * target_k else 0.0
    wound = max(-MAX_SHIFT, min(MAX_SHIFT, drift + gain * error / slope))
    shift = wound + DAMPING * error / slope
    if abs(shift) > MAX_SHIFT:
        return math.copysign(MAX_SHIFT, shift), drift
    return shift, wound


def balance_moves(counts_E: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's update of a choice bias: rate * sign(mean load - load_e), re-centred to mean zero
    (float64). An expert above the mean load gets a lower bias, one below it a higher one."""
    counts_E = counts_E.double()
    moves_E = rate * torch.sign(counts_E.mean() - counts_E)
    return moves_E - moves_E.mean()


def start_added_experts(layer: MoELayer, num_kept: int) -> None:
    """After an event resized the layer's router (kept experts first, then the added ones): with a budget, the
    added experts start UNSET, for the budget to place after their first step (the module docstring)."""
    if layer.config.target_k and isinstance(layer.router, TopAnyRouter):
        with torch.no_grad():
            layer.router.threshold[num_kept:] = UNSET


def share_threshold(hist_B: Tensor, share: float) -> Tuple[float, float]:
    """The lowest bin edge above which at most ``share`` of the counted cosines lie (hist_B: counts per
    BIN-wide bin from -1 to 1), and the share that lies above it: the threshold at which an expert takes that
    share of the tokens, and what it takes."""
    tokens = float(hist_B.sum())
    above_B = hist_B.flip(0).cumsum(0).flip(0)  # counts at or above each bin's lower edge
    fits = (above_B <= share * tokens).nonzero()
    if not len(fits):  # the top bin alone holds more than the share: above every cosine, it takes nothing
        return 1.0, 0.0
    first = int(fits[0])
    return -1.0 + first * BIN, float(above_B[first]) / tokens if tokens else 0.0


def cosine_bins(cos_TU: Tensor) -> Tensor:
    """(U, NUM_BINS) counts of each column's cosines in BIN-wide bins from -1 to 1 (float64)."""
    index_TU = ((cos_TU.double() + 1.0) / BIN).floor().long().clamp(0, NUM_BINS - 1)
    hist_UB = torch.zeros(cos_TU.shape[1], NUM_BINS, dtype=torch.float64, device=cos_TU.device)
    return hist_UB.scatter_add_(1, index_TU.t(), torch.ones_like(index_TU.t(), dtype=torch.float64))


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
        self.drift = 0.0
        """The budget's integral term, in cosine units a step (``budget_shift``): checkpointed."""
        self.started_E: Optional[Tensor] = None
        self.unset: List[int] = []
        """Experts whose threshold the budget sets after this step (UNSET: added by the event before it)."""
        self.start_step()

    def start_step(self) -> None:
        """Zero the step's counts, sized for the layer's experts now (events resize layers between steps), and
        with a budget note the thresholds the step starts from (see ``_move_thresholds``)."""
        router = self.layer.router
        self.started_E = self._thresholds().detach().clone() if self.target_k else None
        self.unset = (self.started_E == UNSET).nonzero().flatten().tolist() if self.started_E is not None else []
        size = 2 + self.layer.num_experts + NUM_BINS * len(self.unset)
        self.counts = torch.zeros(size, dtype=torch.float64, device=router.weight.device)

    def _thresholds(self) -> Tensor:
        router = self.layer.router
        assert isinstance(router, TopAnyRouter), "only a top-any layer has a budget"
        return router.threshold

    def __call__(self, layer: MoELayer, x_TD: Tensor, routing: Routing) -> None:
        if not layer.training:
            return
        mask_TE = routing.mask.detach()
        num_experts = mask_TE.shape[1]
        self.counts[0] += mask_TE.shape[0]
        self.counts[2 : 2 + num_experts] += mask_TE.sum(dim=0)
        if self.target_k:
            self.counts[1] += self._near_pairs(routing)
        if self.unset:
            assert routing.probs is not None, "top-any routing carries its gate scores"
            cos_TU = routing.probs.detach()[:, self.unset].logit()
            self.counts[2 + num_experts :] += cosine_bins(cos_TU).flatten()

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
        num_experts = self.layer.num_experts
        tokens, near, counts_E = summed[0], summed[1], torch.tensor(summed[2 : 2 + num_experts], dtype=torch.float64)
        if tokens <= 0:
            return {}
        hist_UB = torch.tensor(summed[2 + num_experts :], dtype=torch.float64).reshape(len(self.unset), NUM_BINS)
        moves_E = balance_moves(counts_E, self.rate) if self.rate else counts_E.new_zeros(counts_E.shape)
        router = self.layer.router
        if isinstance(router, TopAnyRouter):
            mean_k = float(counts_E.sum()) / tokens
            return self._move_thresholds(router.threshold, moves_E, mean_k, near / tokens, hist_UB)
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

    def _move_thresholds(
        self, threshold_E: Tensor, moves_E: Tensor, mean_k: float, near: float, hist_UB: Tensor
    ) -> Dict[str, float]:
        """With a budget, the optimizer's common move of the layer's thresholds this step is taken back first:
        the budget owns their level, the gradient shapes their differences. A gradient that pushes the level
        the same way every step (the task loss asking for more experts) is a ramp an integrating controller
        follows only a step behind, with an error of push / DAMPING (5 % of k in a small run), and its drift
        term would learn the push only as fast as DRIFT_GAIN allows; taken back at the source, it leaves the
        budget nothing but the slow drift of the gate vectors and the tokens, which the drift term follows."""
        shift, placed_U = 0.0, None
        if self.target_k:
            assert self.started_E is not None, "start_step notes the thresholds when there is a budget"
            threshold_E.sub_((threshold_E - self.started_E).mean())
            placed_U, added_k = self._place_unset(hist_UB, threshold_E.numel())
            slope = self._slope_before(measured_slope(near))
            shift, self.drift = budget_shift(mean_k + added_k, self.target_k, slope, self.drift)
        # a balance move is a choice-bias move: a busy expert (negative move) gets a higher threshold
        threshold_E.add_((shift - moves_E).to(threshold_E))
        if placed_U is not None and self.unset:
            threshold_E[self.unset] = placed_U.to(threshold_E)
        return {"threshold_shift": shift, "threshold_drift": self.drift} if self.target_k else {}

    def _place_unset(self, hist_UB: Tensor, num_experts: int) -> Tuple[Tensor, float]:
        """Thresholds for the unset experts, each taking its share of the budget (target_k / E of the tokens,
        by this step's cosines), and the k they will add: the step's k counts it, so the common shift makes
        room for them."""
        placed = [share_threshold(hist_B, self.target_k / num_experts) for hist_B in hist_UB]
        placed_U = torch.tensor([threshold for threshold, _ in placed], dtype=torch.float64)
        return placed_U, sum(taken for _, taken in placed)


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
        """The budget's averaged slopes and drifts (equal on every rank). The thresholds and choice biases they
        move are the routers' own tensors, saved with the dense state."""
        return {"slopes": [b.slope for b in self.layers], "drifts": [b.drift for b in self.layers]}

    def load_state_dict(self, state: Dict[str, List[Optional[float]]]) -> None:
        slopes = state["slopes"]
        drifts = state.get("drifts", [0.0] * len(slopes))  # saved before the budget had an integral term
        if len(slopes) != len(self.layers) or len(drifts) != len(self.layers):
            raise ValueError(f"saved balance state has {len(slopes)} layers, the model has {len(self.layers)}")
        for balance, slope, drift in zip(self.layers, slopes, drifts):
            balance.slope = slope
            balance.drift = float(drift or 0.0)

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
