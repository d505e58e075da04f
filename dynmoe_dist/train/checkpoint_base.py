"""The frozen base a LoRA run's checkpoint leaves out, and how a resume or an export rebuilds it.

With ``[lora] enabled`` a checkpoint holds what trains: the adapters (the dense ones in ``dense/``, each expert's
in its owner's ``experts_ep{r}.safetensors``), any other parameter that trains, the routers whole (small, and an
adaptive event rewrites their rows even when they are frozen), the optimizer state and the run's bookkeeping.
The frozen weights stay at model.path, which the checkpoint names by path and content hash
(train/model_files.py, checked before anything is read, at resume and at export). A run without LoRA saves
every weight, frozen ones (``model.freeze``) included, as before.

The frozen dense weights are the base's own: a resumed run has them by building the model as a fresh run does,
an export by building it from model.path. An expert's are not always one base expert's: an adaptive event adds
an expert as a linear combination of old experts (parallel/migrate.py, as adaptive.expert_init chose: a copy of
the expert removed or the most activated one, or an average), as the expert last discarded, or as a seeded
random expert, and its frozen weights come with it. So every logical expert has a ``Recipe``: its frozen weights
as a linear combination of the base's experts ('base/J') and seeded random experts ('random/SEED'). A base
expert's recipe is itself; an added expert's is the plan's combination of the old recipes (``planned_recipes``).
A recipe of one term with coefficient 1 (a copy: every strategy but an average) rebuilds the weights bit for
bit; a combination adds its terms in order, as the event did on one rank (on several ranks the event adds the
same products in another order: equal within rounding, as the run itself is on another world size).
An expert whose own weights train (one an event added with ``lora.added_experts = 'trainable'``, or any added
expert where the experts have no adapters) is saved whole; its recipe is then not read.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..moe.adapters import is_adapter
from ..moe.config import MoEConfig
from ..moe.experts import expert_param_specs
from ..moe.layer import dense_state_tensors, find_moe_layers
from ..parallel.migrate import random_expert
from ..planning.planner import AddSpec, LayerPlan
from .dense_state import CheckpointError, NamedParams

Recipe = Tuple[Tuple[str, float], ...]
"""An expert's frozen weights: (term, coefficient) with term 'base/J' (the base's expert J) or 'random/SEED'."""
BaseExperts = Callable[[int, int], Mapping[str, Tensor]]
"""(MoE layer, base expert) -> its frozen weights by parameter name: models.source's ``base_expert``."""
FROZEN_BASE = "frozen_base"  # the experts entry says where the frozen weights are: "model.path"
BASE, RANDOM = "base", "random"


def base_recipes(num_experts: int) -> List[Recipe]:
    return [((f"{BASE}/{expert}", 1.0),) for expert in range(num_experts)]


def combination(parts: Iterable[Tuple[Recipe, float]]) -> Recipe:
    """sum_i c_i * recipe_i, its terms in the order they first appear."""
    total: Dict[str, float] = {}
    for recipe, coeff in parts:
        for term, c in recipe:
            total[term] = total.get(term, 0.0) + coeff * c
    return tuple(total.items())


def planned_recipes(
    lp: LayerPlan, recipes: Sequence[Recipe], discarded: Optional[Recipe]
) -> Tuple[List[Recipe], Optional[Recipe]]:
    """The layer's recipes after ``lp`` (the kept experts, then the added ones) and the remembered discarded
    expert's, formed as parallel.migrate.apply_layer_plan forms the experts."""
    if lp.remember_discarded is not None:
        discarded = recipes[lp.remember_discarded]
    added = [_added_recipe(spec, recipes, discarded) for spec in lp.added]
    return [recipes[old] for old in lp.kept] + added, discarded


def _added_recipe(spec: AddSpec, recipes: Sequence[Recipe], discarded: Optional[Recipe]) -> Recipe:
    if spec.source == "experts":
        return combination((recipes[expert], coeff) for expert, coeff in spec.coeffs)
    if spec.source == "discarded" and discarded is not None:
        return discarded
    return ((f"{RANDOM}/{spec.seed}", 1.0),)  # migrate's fallback too: no discarded expert to reuse


# -- in meta.pt: plain lists ------------------------------------------------------------------------------
def recipe_entry(recipe: Recipe) -> List[List[Any]]:
    return [[term, coeff] for term, coeff in recipe]


def recipe_from(entry: Sequence[Sequence[Any]]) -> Recipe:
    return tuple((str(term), float(coeff)) for term, coeff in entry)


# -- rebuilding ----------------------------------------------------------------------------------------
def frozen_weights(recipe: Recipe, layer: int, config: MoEConfig, like: Tensor, base: BaseExperts) -> Dict[str, Tensor]:
    """One expert's frozen weights (every parameter but its adapters) from its recipe, in ``like``'s dtype and
    device: a copy of one term as it is, a combination summed from zeros term by term as
    parallel.migrate.combine_experts sums it."""
    names = [name for name, _ in expert_param_specs(config) if not is_adapter(name)]
    terms = [(_term_weights(term, layer, config, like, base), coeff) for term, coeff in recipe]
    if len(terms) == 1 and terms[0][1] == 1.0:
        return {name: terms[0][0][name].to(device=like.device, dtype=like.dtype) for name in names}
    out: Dict[str, Tensor] = {}
    for name in names:
        total = torch.zeros_like(terms[0][0][name], device=like.device, dtype=like.dtype)
        for weights, coeff in terms:
            total += coeff * weights[name].to(device=like.device, dtype=like.dtype)
        out[name] = total
    return out


def _term_weights(term: str, layer: int, config: MoEConfig, like: Tensor, base: BaseExperts) -> Mapping[str, Tensor]:
    kind, _, number = term.partition("/")
    if kind == BASE:
        return base(layer, int(number))
    if kind == RANDOM:  # the event's own draw: seeded, on the host, then cast
        return {name: p.detach() for name, p in random_expert(config, int(number), like).named_parameters()}
    raise CheckpointError(f"expert recipe term {term!r} is neither '{BASE}/J' nor '{RANDOM}/SEED'")


def with_frozen(
    params: Mapping[str, Tensor], recipe: Recipe, layer: int, config: MoEConfig, like: Tensor, base: BaseExperts
) -> Dict[str, Tensor]:
    """An expert's saved parameters (what trains) with the frozen ones rebuilt from its recipe, by name in
    ``expert_param_specs`` order; a missing adapter is a CheckpointError naming it."""
    names = [name for name, _ in expert_param_specs(config)]
    missing = frozen_names(params, config)
    if not missing:
        return {name: params[name] for name in names}
    lost = [name for name in missing if is_adapter(name)]
    if lost:
        raise CheckpointError(f"MoE layer {layer}: an expert's saved parameters lack {lost[0]!r}, which trains")
    frozen = frozen_weights(recipe, layer, config, like, base)
    return {name: params[name] if name in params else frozen[name] for name in names}


def frozen_names(saved: Mapping[str, Tensor], config: MoEConfig) -> List[str]:
    """The parameters of an expert a LoRA checkpoint did not save: the frozen ones."""
    return [name for name, _ in expert_param_specs(config) if name not in saved]


# -- what the checkpoint holds ---------------------------------------------------------------------------
def trained_dense_tensors(model: torch.nn.Module) -> NamedParams:
    """A LoRA checkpoint's dense state: every dense parameter that trains, and the MoE routers whole (their
    parameters and saved buffers: small, and rewritten by adaptive events even when frozen)."""
    router_tensors = {
        id(t) for _, layer in find_moe_layers(model) for t in [*layer.router.parameters(), *layer.router.buffers()]
    }
    return [(name, t) for name, t in dense_state_tensors(model) if t.requires_grad or id(t) in router_tensors]
