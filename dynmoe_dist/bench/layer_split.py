"""The split of one MoE layer's training step into its phases, for top-any and top-k at the same mean k
(``python -m dynmoe_dist.bench layer`` reports it at several sizes: ``--split-sizes``).

Each phase runs on its own, forward and backward, on the inputs the layer hands it (fixed, detached:
the phase's own work only) and a fixed gradient from downstream:
  router    x -> Routing, backward from the combine weights (top-any: cosines, sigmoid, thresholds, the
            straight-through gate, 1/k; top-k: logits, softmax, top-k, renormalisation)
  losses    the layer's aux losses from that routing (top-any: the reference's four; top-k: Switch),
            backward to the routing's weights, gates and probabilities and the gate vectors
  dispatch  permute the routed rows and combine them again with the weights (experts as the identity)
  experts   the expert matmuls on the routed rows
  whole     the layer's whole step (the headline cases' step): the phases plus autograd's glue between them

Shape legend: T tokens, D model dim, E experts, R routed rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from dynmoe_dist.bench import measure
from dynmoe_dist.bench.layer_cases import CaseSpec, build_layer, calibrate_top_any, make_tokens, moe_step
from dynmoe_dist.moe.layer import MoELayer
from dynmoe_dist.moe.routing import Routing

PHASES = ("router", "losses", "dispatch", "experts", "whole")
ROUTERS = ("top_any", "top_k")
# (T, D, F, E): the shape, a wider layer with more experts, and many tokens in a narrow one
DEFAULT_SIZES = "4096x256x512x8,2048x512x1024x16,16384x128x256x8"


def parse_sizes(text: str) -> List[Tuple[int, int, int, int]]:
    """'TxDxFxE,...' -> [(T, D, F, E), ...] ('' -> none)."""
    sizes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        numbers = item.split("x")
        if len(numbers) != 4 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise ValueError(f"--split-sizes entry ({item!r}) must be TxDxFxE, four positive integers")
        tokens, dim, ffn_dim, experts = map(int, numbers)
        sizes.append((tokens, dim, ffn_dim, experts))
    return sizes


def _zeroing(tensors: List[Tensor]):
    def zero() -> None:
        for t in tensors:
            t.grad = None

    return zero


def _leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(True)


def phase_steps(layer: MoELayer, x_TD: Tensor, grad_TD: Tensor) -> Dict[str, measure.Step]:
    """One step per phase of ``layer`` on ``x_TD`` (see the module docstring)."""
    with torch.no_grad():
        routing = layer.router(x_TD, True)
    generator = torch.Generator().manual_seed(3)
    grad_weights_TE = torch.randn(routing.weights.shape, generator=generator, dtype=routing.weights.dtype)
    leaf = Routing(
        routing.mask, _leaf(routing.weights), routing.num_selected, _leaf(routing.gates), _leaf(routing.probs)
    )
    rows_RD, counts_e, meta = layer.dispatcher.dispatch(x_TD, leaf)
    rows_RD = rows_RD.detach().requires_grad_(True)
    grad_RD = torch.randn(rows_RD.shape, generator=generator, dtype=rows_RD.dtype)
    sizes_e = getattr(meta, "sizes_e", None)
    router_params = list(layer.router.parameters())
    zero_router = _zeroing([*router_params, x_TD])
    zero_losses = _zeroing([*router_params, *(t for t in (leaf.weights, leaf.gates, leaf.probs) if t is not None)])
    zero_dispatch = _zeroing([x_TD, leaf.weights])
    zero_experts = _zeroing([*layer.experts.parameters(), rows_RD])

    def router() -> None:
        zero_router()
        layer.router(x_TD, True).weights.backward(grad_weights_TE)

    def aux_losses() -> None:
        zero_losses()
        layer.aux_loss(leaf).backward()

    def dispatch() -> None:
        zero_dispatch()
        moved_RD, _, moved = layer.dispatcher.dispatch(x_TD, leaf)
        layer.dispatcher.combine(moved_RD, moved).backward(grad_TD)

    def experts() -> None:
        zero_experts()
        layer.experts(rows_RD, counts_e, sizes_e).backward(grad_RD)

    return {
        "router": router,
        "losses": aux_losses,
        "dispatch": dispatch,
        "experts": experts,
        "whole": moe_step(layer, x_TD, grad_TD),
    }


def split_layers(spec: CaseSpec) -> Dict[str, Tuple[MoELayer, Tensor, Tensor, float]]:
    """top_any (thresholds calibrated to mean k = spec.k) and top_k (k = spec.k) on the same experts and
    tokens: router -> (layer, tokens, output gradient, mean k)."""
    built = {}
    for router in ROUTERS:
        layer = build_layer(replace(spec, case=router), router)
        x_TD, grad_TD = make_tokens(spec)
        mean_k = calibrate_top_any(layer, x_TD, spec.k) if router == "top_any" else float(spec.k)
        built[router] = (layer, x_TD, grad_TD, mean_k)
    return built


def split_at(spec: CaseSpec, repeats: int, warmup: int) -> dict:
    """Every phase of both routers at one size, timed round-robin together; ratios top_any / top_k."""
    built = split_layers(spec)
    steps = {
        f"{router}.{phase}": step
        for router, (layer, x_TD, grad_TD, _) in built.items()
        for phase, step in phase_steps(layer, x_TD, grad_TD).items()
    }
    timings = measure.time_interleaved(steps, repeats=repeats, warmup=warmup)
    row: Dict[str, object] = {
        "shape": {"tokens": spec.tokens, "dim": spec.dim, "ffn_dim": spec.ffn_dim, "num_experts": spec.num_experts},
        "mean_k": {router: round(built[router][3], 4) for router in ROUTERS},
    }
    for router in ROUTERS:
        ms = {phase: timings[f"{router}.{phase}"]["ms_min"] for phase in PHASES}
        ms["glue"] = round(ms["whole"] - sum(ms[p] for p in PHASES if p != "whole"), 2)
        row[router] = ms
    row["top_any_over_top_k"] = {
        phase: _over(timings[f"top_any.{phase}"]["ms_min"], timings[f"top_k.{phase}"]["ms_min"]) for phase in PHASES
    }
    return row


def _over(top: float, bottom: float) -> Optional[float]:
    return round(top / bottom, 3) if bottom else None


def run_split(base: CaseSpec, sizes: List[Tuple[int, int, int, int]], repeats: int, warmup: int) -> dict:
    rows = [split_at(replace(base, tokens=t, dim=d, ffn_dim=f, num_experts=e), repeats, warmup) for t, d, f, e in sizes]
    worst = max((r["top_any_over_top_k"]["whole"] for r in rows if r["top_any_over_top_k"]["whole"]), default=None)
    return {
        "method": (
            "each phase alone, forward+backward on the layer's own inputs to it (detached) and a fixed gradient; "
            "both routers' phases timed round-robin; ms_min; glue = whole - the phases"
        ),
        "rows": rows,
        "worst_whole_ratio": worst,
    }
