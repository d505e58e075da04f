"""The models of a comparison: each a name, a table label, a family and the overrides that make it.

Every model of a comparison shares the task preset, the budget and the seed set; only these overrides
differ. Families: 'dense' (no MoE layer at all), 'top_k', 'top_p' (the baselines of docs/algorithm.md
section 5) and 'dynmoe' (top-any routing with adaptive experts, section 1 and 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

FAMILIES = ("dense", "top_k", "top_p", "dynmoe")
FOUR_LOSSES = ("diverse", "simple", "load_balance", "efficiency")
PAPER_LOSSES = ("diverse", "simple")  # the first paper version's two (algorithm.md section 2)
EXPERT_INITS = ("reuse_discarded", "average", "weighted_average", "most_activated", "random")
TOP_P = 0.4  # Huang et al.'s p


@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    overrides: Tuple[str, ...]
    family: str = "dynmoe"

    @property
    def is_dynmoe(self) -> bool:
        return self.family == "dynmoe"


def _losses_value(names: Tuple[str, ...]) -> str:
    return "moe.aux_losses=[" + ", ".join(f'"{n}"' for n in names) + "]"


def dense() -> ModelSpec:
    # No MoE layer: every block keeps its dense FFN (width F), so it costs what top-1 costs per token. The
    # preset is pinned (it fills moe options the model never reads) so that a change of the project's
    # default preset does not invalidate its saved runs.
    return ModelSpec(
        "dense", "dense (no MoE)", ("model.moe_layers=[]", "moe.preset='paper'", "adaptive.enabled=false"), "dense"
    )


def top_k(k: int) -> ModelSpec:
    # Adaptive off: a top-k layer never adds or removes experts, and on one rank there is nothing to
    # re-place, so the baseline is the plain fixed-k MoE of the paper.
    return ModelSpec(
        f"top{k}", f"MoE k={k}", ("moe.router='top_k'", f"moe.top_k={k}", "adaptive.enabled=false"), "top_k"
    )


def top_p(p: float = TOP_P) -> ModelSpec:
    # Huang et al. train with the load-balance loss plus their router-entropy loss; both are named here so
    # a change of the router's default aux losses cannot silently change the baseline.
    return ModelSpec(
        f"top-p{p:g}",
        f"top-p p={p:g} (+entropy)",
        ("moe.router='top_p'", f"moe.top_p={p}", _losses_value(("switch", "entropy")), "adaptive.enabled=false"),
        "top_p",
    )


def dynmoe_init(init: str) -> ModelSpec:
    """DynMoE with one expert-init strategy and the losses of the moe.preset in force."""
    return ModelSpec(
        f"dynmoe-{init}",
        f"DynMoE ({init.replace('_', ' ')})",
        ("moe.router='top_any'", "adaptive.enabled=true", f"adaptive.expert_init='{init}'"),
    )


def dynmoe_losses(name: str, label: str, losses: Tuple[str, ...]) -> ModelSpec:
    """DynMoE on the reference settings (moe.preset 'paper', reuse discarded) with an explicit loss set.
    The preset is pinned so the ablation measures the losses alone, and a change of the project's
    default preset neither changes these runs nor invalidates their saved results."""
    return ModelSpec(
        name,
        label,
        (
            "moe.router='top_any'",
            "moe.preset='paper'",
            "adaptive.enabled=true",
            "adaptive.expert_init='reuse_discarded'",
            _losses_value(losses),
        ),
    )


def loss_ablations() -> List[ModelSpec]:
    """The four losses, the paper's original two, and each of the four switched off in turn."""
    specs = [
        dynmoe_losses("dynmoe-losses-four", "DynMoE, 4 losses", FOUR_LOSSES),
        dynmoe_losses("dynmoe-losses-paper", "DynMoE, div+simple (paper v1)", PAPER_LOSSES),
    ]
    for off in FOUR_LOSSES:
        kept = tuple(n for n in FOUR_LOSSES if n != off)
        specs.append(dynmoe_losses(f"dynmoe-no-{off}", f"DynMoE, no {off.replace('_', ' ')}", kept))
    return specs


MODELS: Dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        dense(),
        *(top_k(k) for k in (1, 2, 4, 8)),
        top_p(),
        *(dynmoe_init(init) for init in EXPERT_INITS),
        *loss_ablations(),
    )
}
# Every model; `compare --models default` then drops a model whose config equals an earlier one's (as
# dynmoe-losses-four does dynmoe-reuse_discarded's while the moe.preset's losses are the four).
DEFAULT_MODELS = list(MODELS)
LOSS_MODELS = [spec.name for spec in loss_ablations()]
