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
random expert, and its frozen weights come with it. So every logical expert has a ``Recipe``, one term: 'base/J'
(the base's expert J, as read), 'random/SEED' (a seeded random expert, as drawn) or 'formed/I' (the I-th
combination an event formed in its layer). A layer's ``formed`` combinations are the sums the events computed:
from zeros, each term's coefficient times that expert's weights as the run held them (a low-precision base's
stored weights widened: bf16 rounded, NF4 quantised and dequantised), which the run then stored again. A resume
or an export repeats exactly that (``frozen_weights``), so a rebuilt expert holds the run's bits whatever the
base dtype: an NF4 expert formed from NF4 experts is re-quantised from their dequantised values, as the event
re-quantised it (NF4 is not idempotent: quantising the float base once would give other bits), while the base's
own experts are the float base quantised once, as the run quantised them. A copy (one term, coefficient 1:
every strategy but an average) is bit for bit on any world size; an average adds its terms in order, as the
event did on one rank (on several ranks the event adds the same products in another order: equal within
rounding, as the run itself is on another world size). ``LayerRecipes`` holds a layer's: its experts', its
remembered discarded expert's and the combinations they reach (older ones dropped).
An expert whose own weights train (one an event added with ``lora.added_experts = 'trainable'``, or any added
expert where the experts have no adapters) is saved whole; its recipe is then not read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from ..moe import frozen_base
from ..moe.adapters import is_adapter
from ..moe.config import MoEConfig
from ..moe.experts import expert_param_specs
from ..moe.layer import dense_state_tensors, find_moe_layers
from ..parallel.migrate import drawn_expert
from ..planning.planner import LayerPlan
from .dense_state import CheckpointError, NamedParams

Recipe = Tuple[Tuple[str, float], ...]
"""An expert's frozen weights: (term, coefficient) with term 'base/J' (the base's expert J), 'random/SEED' or
'formed/I' (its layer's I-th formed combination). An expert's own recipe is one term with coefficient 1; a
formed combination has any (a checkpoint written before 'formed/I' existed keeps an event's combination in the
expert's own recipe, with base and random terms: read as a formed combination)."""
BaseExperts = Callable[[int, int], Mapping[str, Tensor]]
"""(MoE layer, base expert) -> its frozen weights by parameter name: models.source's ``base_expert``."""
FROZEN_BASE = "frozen_base"  # the experts entry says where the frozen weights are: "model.path"
BASE, RANDOM, FORMED = "base", "random", "formed"


@dataclass(frozen=True)
class FrozenBase:
    """Where a LoRA run's frozen expert weights come from, and how the run stored them."""

    expert: BaseExperts
    dtype: str
    """lora.base_dtype: 'run', 'bfloat16' or 'nf4' (moe/frozen_base.py)."""


@dataclass(frozen=True)
class LayerRecipes:
    """One MoE layer's recipes: each logical expert's, the remembered discarded expert's, and the combinations
    events formed that these reach."""

    experts: Tuple[Recipe, ...]
    discarded: Optional[Recipe] = None
    formed: Tuple[Recipe, ...] = ()

    @classmethod
    def of_base(cls, num_experts: int) -> "LayerRecipes":
        return cls(tuple(((f"{BASE}/{expert}", 1.0),) for expert in range(num_experts)))

    def planned(self, lp: LayerPlan) -> "LayerRecipes":
        """The recipes after ``lp`` (the kept experts, then the added ones), formed as
        parallel.migrate.apply_layer_plan forms the experts: the discarded expert first (a combination of one
        term, as combine_experts sums it), then each added one (a combination of old experts; the discarded
        expert copied into a new expert, which stores it again; or a seeded random one)."""
        formed = list(self.formed)

        def form(combo: Recipe) -> Recipe:
            formed.append(combo)
            return ((f"{FORMED}/{len(formed) - 1}", 1.0),)

        def term(recipe: Recipe) -> str:
            if len(recipe) == 1 and recipe[0][1] == 1.0:
                return recipe[0][0]
            return form(recipe)[0][0]  # an older checkpoint's combination, kept in the expert's own recipe

        discarded = self.discarded
        if lp.remember_discarded is not None:
            discarded = form(((term(self.experts[lp.remember_discarded]), 1.0),))
        added = []
        for spec in lp.added:
            if spec.source == "experts":
                added.append(form(tuple((term(self.experts[e]), coeff) for e, coeff in spec.coeffs)))
            elif spec.source == "discarded" and discarded is not None:
                added.append(form(((term(discarded), 1.0),)))
            else:  # migrate's fallback too: no discarded expert to reuse
                added.append(((f"{RANDOM}/{spec.seed}", 1.0),))
        kept = tuple(self.experts[old] for old in lp.kept)
        return LayerRecipes(kept + tuple(added), discarded, tuple(formed)).pruned()

    def pruned(self) -> "LayerRecipes":
        """Without the formed combinations nothing reaches any more, the others renumbered in order (a
        combination names only earlier ones)."""
        reached = set()
        pending = [t for recipe in self._roots() for t, _ in recipe]
        while pending:
            index = _formed_index(pending.pop())
            if index is not None and index not in reached:
                reached.add(index)
                pending += [t for t, _ in self.formed[index]]
        number = {old: new for new, old in enumerate(sorted(reached))}

        def renamed(recipe: Recipe) -> Recipe:
            return tuple((_renumbered(t, number), c) for t, c in recipe)

        discarded = None if self.discarded is None else renamed(self.discarded)
        kept_formed = tuple(renamed(self.formed[old]) for old in sorted(reached))
        return LayerRecipes(tuple(renamed(r) for r in self.experts), discarded, kept_formed)

    def _roots(self) -> List[Recipe]:
        return [*self.experts, *([] if self.discarded is None else [self.discarded])]


def _formed_index(term: str) -> Optional[int]:
    kind, _, number = term.partition("/")
    return int(number) if kind == FORMED else None


def _renumbered(term: str, number: Mapping[int, int]) -> str:
    index = _formed_index(term)
    return term if index is None else f"{FORMED}/{number[index]}"


# -- in meta.pt: plain lists ------------------------------------------------------------------------------
def recipe_entry(recipe: Recipe) -> List[List[Any]]:
    return [[term, coeff] for term, coeff in recipe]


def recipe_from(entry: Sequence[Sequence[Any]]) -> Recipe:
    return tuple((str(term), float(coeff)) for term, coeff in entry)


def recipes_entry(layers: Sequence[LayerRecipes]) -> Dict[str, Any]:
    """The recipes of every layer, as an experts entry of meta.pt holds them."""
    return {
        "recipes": [[recipe_entry(r) for r in layer.experts] for layer in layers],
        "discarded_recipes": [None if layer.discarded is None else recipe_entry(layer.discarded) for layer in layers],
        "formed_recipes": [[recipe_entry(r) for r in layer.formed] for layer in layers],
    }


def recipes_from(entry: Mapping[str, Any]) -> List[LayerRecipes]:
    """``recipes_entry``'s inverse (a checkpoint written before 'formed' combinations has none)."""
    formed = entry.get("formed_recipes") or [[] for _ in entry["recipes"]]
    return [
        LayerRecipes(
            tuple(recipe_from(r) for r in experts),
            None if discarded is None else recipe_from(discarded),
            tuple(recipe_from(r) for r in combos),
        )
        for experts, discarded, combos in zip(entry["recipes"], entry["discarded_recipes"], formed, strict=True)
    ]


# -- rebuilding ----------------------------------------------------------------------------------------
class LayerBase:
    """One MoE layer's frozen expert weights rebuilt from recipes as the run computed them, in ``like``'s dtype
    and device: an expert's weights before the run stored them (``frozen_weights``), which whoever builds the
    expert stores as the run did."""

    def __init__(self, index: int, config: MoEConfig, like: Tensor, base: FrozenBase, formed: Sequence[Recipe]):
        self.index, self.config, self.like, self.base, self.formed = index, config, like, base, formed
        self.names = [name for name, _ in expert_param_specs(config) if not is_adapter(name)]

    def frozen_weights(self, recipe: Recipe) -> Dict[str, Tensor]:
        if len(recipe) == 1 and recipe[0][1] == 1.0:
            index = _formed_index(recipe[0][0])
            return self._leaf(recipe[0][0]) if index is None else self._formed_sum(index)
        return self._summed(recipe, {})  # an older checkpoint's combination in the expert's own recipe

    def with_frozen(self, params: Mapping[str, Tensor], recipe: Recipe) -> Dict[str, Tensor]:
        """An expert's saved parameters (what trains) with the frozen ones rebuilt from its recipe, by name in
        ``expert_param_specs`` order; a missing adapter is a CheckpointError naming it."""
        names = [name for name, _ in expert_param_specs(self.config)]
        missing = frozen_names(params, self.config)
        if not missing:
            return {name: params[name] for name in names}
        lost = [name for name in missing if is_adapter(name)]
        if lost:
            raise CheckpointError(
                f"MoE layer {self.index}: an expert's saved parameters lack {lost[0]!r}, which trains"
            )
        frozen = self.frozen_weights(recipe)
        return {name: params[name] if name in params else frozen[name] for name in names}

    def _formed_sum(self, root: int) -> Dict[str, Tensor]:
        """Formed combination ``root`` summed: the combinations it reaches first, in order (each names earlier
        ones only), each computed once and held (as the run held that expert) until its last use."""
        needed = self._reached(root)
        uses = Counter(i for j in needed for i in (_formed_index(t) for t, _ in self.formed[j]) if i is not None)
        held: Dict[int, Dict[str, Tensor]] = {}
        for index in sorted(needed):
            summed = self._summed(self.formed[index], held)
            if index == root:
                return summed
            for used in (_formed_index(t) for t, _ in self.formed[index]):
                if used is not None:
                    uses[used] -= 1
                    if not uses[used]:
                        del held[used]
            held[index] = self._held(summed)
        raise AssertionError("the root is reached")

    def _reached(self, root: int) -> Set[int]:
        reached: Set[int] = set()
        pending = [root]
        while pending:
            index = pending.pop()
            if index >= len(self.formed):
                raise CheckpointError(f"MoE layer {self.index}: recipe term '{FORMED}/{index}' names no combination")
            if index not in reached:
                reached.add(index)
                pending += [i for i in (_formed_index(t) for t, _ in self.formed[index]) if i is not None]
        return reached

    def _summed(self, combo: Recipe, held: Mapping[int, Dict[str, Tensor]]) -> Dict[str, Tensor]:
        """From zeros, coefficient times each term as the run held it: parallel.migrate.combine_experts' sum
        (``held``: the formed combinations it names)."""
        out: Dict[str, Tensor] = {}
        for term, coeff in combo:
            index = _formed_index(term)
            source = self._held(self._leaf(term)) if index is None else held[index]
            for name in self.names:
                out.setdefault(name, torch.zeros_like(source[name]))
                out[name] += coeff * source[name]
        return out

    def _leaf(self, term: str) -> Dict[str, Tensor]:
        """A base expert as read, or a seeded random one as drawn (on the host, then cast), not yet stored."""
        kind, _, number = term.partition("/")
        if kind == BASE:
            read = self.base.expert(self.index, int(number))
        elif kind == RANDOM:
            read = dict(drawn_expert(self.config, int(number), self.like).named_parameters())
        else:
            raise CheckpointError(
                f"expert recipe term {term!r} is neither '{BASE}/J', '{RANDOM}/SEED' nor '{FORMED}/I'"
            )
        like = self.like
        return {name: read[name].detach().to(device=like.device, dtype=like.dtype) for name in self.names}

    def _held(self, weights: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """An expert's weights as the run held them: stored as lora.base_dtype says, widened again (biases stay)."""
        return {
            name: frozen_base.stored(w, self.base.dtype).to(w.dtype) if name in frozen_base.EXPERT_WEIGHTS else w
            for name, w in weights.items()
        }


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
