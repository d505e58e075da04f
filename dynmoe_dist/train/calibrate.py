"""Calibrating the thresholds of routers converted to top-any from an imported MoE (moe/calibration.py), at
the start of a fresh run, on a sample of the training data routed by every rank together.

Layer by layer, in order: the sample's forward up to layer l depends on the thresholds of the layers
before it, so each layer is calibrated on inputs the calibrated layers before it produced (L forwards of
a small sample). For layer l every rank routes its tokens both ways, the model's own rule (the checkpoint's
router and its bias / correction bias) and the cosines top-any reads; the native counts are summed over all
ranks, and the cosines are laid out by rank into one buffer all ranks sum, so every rank sets the same
thresholds from the same numbers whatever the world size.

``calibrate_converted`` is handed what it works on (the model source, the parts, a sample of batches), never
the trainer: the source says whether there is anything to calibrate and holds the checkpoint's routings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..models.hf.imported import NativeRouting
from ..models.source import ModelSource
from ..moe.calibration import calibrated_counts, thresholds_for_counts
from ..moe.layer import MoELayer, TopAnyRouter
from ..moe.routing import cosine_scores, native
from ..parallel.groups import ParallelGroups, sum_over_ranks
from .parts import TrainParts
from .progress import WaitBar


@dataclass(frozen=True)
class LayerCalibration:
    layer: int
    target_k: float
    mean_k: float
    """Mean experts per token the calibrated thresholds select on the sample (before any k = 0 rule)."""
    never_chosen: List[int]
    """Experts the model's own routing sent no token of the sample: their thresholds lie above every cosine."""

    def record(self) -> Dict:
        return {
            "layer": self.layer,
            "target_k": self.target_k,
            "mean_k": self.mean_k,
            "never_chosen": self.never_chosen,
        }


def calibrate(
    forward: Callable[[], None],
    layers: Sequence[MoELayer],
    natives: Sequence[NativeRouting],
    target_k: float,
    groups: ParallelGroups,
    bar: Optional[WaitBar] = None,
) -> List[LayerCalibration]:
    """Set every converted layer's thresholds; ``forward`` runs the model on this rank's share of the sample.
    ``bar`` advances by one per layer calibrated (a forward of the sample each)."""
    done = []
    for index, (layer, native_) in enumerate(zip(layers, natives)):
        done.append(calibrate_layer(index, layer, native_, forward, target_k, groups))
        if bar is not None:
            bar.advance()
    return done


def calibrate_layer(
    index: int,
    layer: MoELayer,
    native_: NativeRouting,
    forward: Callable[[], None],
    target_k: float,
    groups: ParallelGroups,
) -> LayerCalibration:
    router = layer.router
    assert isinstance(router, TopAnyRouter), "only routers converted to top-any are calibrated"
    x_TD = _layer_input(layer, forward)
    with torch.no_grad():
        cos_TE = cosine_scores(x_TD, router.weight).double()
        mask_TE = native(
            x_TD,
            native_.weight.to(x_TD),
            native_.rule,
            bias_E=_on(native_.bias, x_TD),
            correction_E=_on(native_.correction, x_TD),
        ).mask
        counts_E = sum_over_ranks(mask_TE.sum(dim=0).double().cpu(), groups, "calibration native counts all_reduce")
        all_cos_TE = _all_tokens(cos_TE.cpu(), groups)
        want_E = calibrated_counts(counts_E, all_cos_TE.shape[0], native_.rule.top_k, target_k)
        thresholds_E = thresholds_for_counts(all_cos_TE, want_E)
        router.threshold.copy_(thresholds_E.to(router.threshold))
        chosen_E = (all_cos_TE > thresholds_E).sum(dim=0)
    mean_k = float(chosen_E.sum()) / max(all_cos_TE.shape[0], 1)
    never = [e for e in range(len(counts_E)) if counts_E[e] == 0]
    return LayerCalibration(index, target_k, mean_k, never)


def _on(t, like: Tensor):
    return None if t is None else t.to(like.device)


def _layer_input(layer: MoELayer, forward: Callable[[], None]) -> Tensor:
    """The tokens entering ``layer`` during one forward of the sample."""
    seen: List[Tensor] = []

    def capture(_layer: MoELayer, x_TD: Tensor, _routing) -> None:
        seen.append(x_TD.detach())

    layer.routing_observers.append(capture)
    try:
        forward()
    finally:
        layer.routing_observers.remove(capture)
    return torch.cat(seen)


def _all_tokens(local_TE: Tensor, groups: ParallelGroups) -> Tensor:
    """Every rank's rows in rank order, on every rank: each fills its own rows of a zero buffer, one sum."""
    sizes = torch.zeros(groups.world_size, dtype=torch.float64)
    sizes[groups.rank] = local_TE.shape[0]
    sizes = sum_over_ranks(sizes, groups, "calibration token counts all_reduce").long()
    start = int(sizes[: groups.rank].sum())
    buffer = local_TE.new_zeros(int(sizes.sum()), local_TE.shape[1])
    buffer[start : start + local_TE.shape[0]] = local_TE
    return sum_over_ranks(buffer, groups, "calibration cosines all_reduce")


def calibrate_converted(
    source: ModelSource,
    parts: TrainParts,
    sample: Callable[[], Dict[str, Tensor]],
    target_k: float,
    autocast: Callable[[], ContextManager],
    progress: bool = False,
) -> Optional[Dict]:
    """Routers converted to top-any from an imported MoE: calibrate their thresholds on ``sample()`` (this
    rank's share of the first moe.calibrate_samples training sequences, the model's inputs) to
    ``target_k`` experts per token (0: the model's own top-k). Returns the calibration's target and
    layers; None when the source has nothing to calibrate (``sample`` is then never called). ``progress``: a
    bar over the layers (rank 0, output.progress)."""
    natives = source.routings_to_calibrate()
    if natives is None:
        return None
    target_k = float(target_k or natives[0].rule.top_k)
    inputs = sample()

    def forward() -> None:
        parts.model.train()
        with torch.no_grad(), autocast():
            parts.model(**inputs)

    with WaitBar("calibrating top-any thresholds", len(parts.experts.layers), "layer", enabled=progress) as bar:
        layers = calibrate(forward, parts.experts.layers, natives, target_k, parts.groups, bar)
    return {"target_k": target_k, "layers": [layer.record() for layer in layers]}
