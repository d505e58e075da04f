"""Calibrating the thresholds of routers converted to top-any from an imported MoE (moe/calibration.py), at
the start of a fresh run, on a sample of the training data routed by every rank together.

Layer by layer, in order: the sample's forward up to layer l depends on the thresholds of the layers
before it, so each layer is calibrated on inputs the calibrated layers before it produced (L forwards of
a small sample). For layer l every rank routes its tokens both ways, the model's own rule (the checkpoint's
router and its bias / correction bias) and the cosines top-any reads; the native counts are summed over all
ranks, and the cosines are laid out by rank into one buffer all ranks sum, so every rank sets the same
thresholds from the same numbers whatever the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..models.hf.imported import NativeRouting, native_routings
from ..models.hf.loading import resolve
from ..models.hf.moe_families import imported_moe
from ..moe.calibration import calibrated_counts, thresholds_for_counts
from ..moe.layer import MoELayer, TopAnyRouter
from ..moe.routing import cosine_scores, native
from ..parallel.groups import ParallelGroups, sum_over_ranks
from .telemetry import WaitBar


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


def calibrate_converted(trainer) -> Optional[Dict]:
    """A fresh run that converted an imported MoE's routers to top-any: calibrate them on the first
    moe.calibrate_samples training sequences (every rank its share), then evaluate the held-out split once,
    before any step. Returns the run's 'calibration' record; None for any other run."""
    config = trainer.config
    if config.moe.router != "top_any" or config.model.source != "hf":
        return None
    directory, gguf_file = resolve(config.model.path)
    if gguf_file is not None or imported_moe(directory) is None:
        return None
    natives = native_routings(directory, trainer.model.transformers_model())
    # the budget when there is one (MoEConfig refuses a calibrate_k that differs), else calibrate_k, else the model's k
    target_k = float(config.moe.target_k or config.moe.calibrate_k or natives[0].rule.top_k)
    size = trainer.task.size("train")
    batch = trainer.local_batch("train", torch.arange(min(size, max(config.moe.calibrate_samples, trainer.world_size))))

    def forward() -> None:
        trainer.model.train()
        with torch.no_grad(), trainer.autocast():
            trainer.model(**batch.inputs)

    shown = trainer.is_rank0 and config.output.progress
    with WaitBar("calibrating top-any thresholds", len(trainer.moe_layers), "layer", enabled=shown) as bar:
        layers = calibrate(forward, trainer.moe_layers, natives, target_k, trainer.groups, bar)
    scores = trainer.evaluate("held-out scoring after the conversion")
    return {
        "kind": "calibration",
        "step": trainer.step,
        "target_k": target_k,
        "layers": [layer.record() for layer in layers],
        **{f"{key}_after_conversion": value for key, value in scores.items()},
    }
