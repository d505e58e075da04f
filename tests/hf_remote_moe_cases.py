"""Tiny transformers MoE models of every family imported with DynMoE routing and non-trivial state,
exported as remote-code directories, for tests/unit/test_hf_remote_moe.py (built from configs: nothing is
downloaded).

Every weight is random (hf_tiny.randomize), so experts differ; the first MoE layer keeps 4 of its 6 experts
(router ``resize`` + bank ``keep``, as an adaptive removal does) and the last grows a seventh, so the counts
differ per layer and from the config's; top-any thresholds are spread per expert, so tokens select 0, 1 or
several experts and the combine rule and the k = 0 rule both show in the logits.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch
from hf_tiny import randomize, tiny_model

from dynmoe_dist.hf import import_moe
from dynmoe_dist.models.hf.pretrained import dynmoe_section, save_exported
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.experts import new_expert
from dynmoe_dist.moe.layer import MoELayer, TopAnyRouter, find_moe_layers

VOCAB = 48
KEEP = [0, 2, 3, 5]  # of the 6 experts of the first MoE layer
# cos(x, W_e) > G_e selects expert e. Thresholds spread over THRESHOLD_RANGE, shifted up by THRESHOLD_SHIFT per
# expert above 6 (more experts, more choices): then in every layer of every family, with either combine, at least
# 2 of the 27 sample tokens select none, 2 exactly one and 2 several (measured).
THRESHOLD_RANGE = (0.0, 0.5)
# families whose cosines sit elsewhere at these sizes take their own range (measured the same way)
FAMILY_THRESHOLD_RANGE = {"glm4_moe": (0.01, 0.3), "mistral4": (0.04, 0.62)}
THRESHOLD_SHIFT = 0.05
# gpt-oss's clamp must bite at these sizes (the stock limit, 7, never does), and alpha be no default value
OVERRIDES = {"gpt_oss": {"swiglu_alpha": 1.5, "swiglu_limit": 1.0}}


@dataclass(frozen=True)
class Case:
    family: str
    router: str = "top_any"
    combine: str = "equal"
    eval_k0: str = "top1"
    dtype: torch.dtype = torch.float64

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.family}_{self.router}_{self.combine}_{self.eval_k0}_{dtype}"

    def moe(self) -> MoEConfig:
        return MoEConfig(router=self.router, combine=self.combine, eval_k0=self.eval_k0)


def family_cases(family: str, baselines: bool = False) -> Dict[str, Case]:
    """Both combine modes x both eval k = 0 rules in float64, one float32 case, and with ``baselines`` the
    top-k and top-p routers: {name: case}."""
    cases = [Case(family, combine=c, eval_k0=k) for c in ("equal", "softmax") for k in ("top1", "skip")]
    cases.append(Case(family, combine="softmax", dtype=torch.float32))
    if baselines:
        cases += [Case(family, router="top_k"), Case(family, router="top_p")]
    return {case.name: case for case in cases}


def grow(layer: MoELayer, generator: torch.Generator) -> None:
    """One more expert (random weights, random router row, threshold 0), as an adaptive addition."""
    like = next(layer.experts.parameters())
    expert = new_expert(layer.config).to(like)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
    row_1D = torch.randn(1, layer.config.dim, generator=generator, dtype=torch.float64)
    layer.router.resize(list(range(layer.num_experts)), row_1D.to(layer.router.weight))
    layer.experts.set_experts([*layer.experts.experts, expert])


def spread_thresholds(layer: MoELayer, family: str) -> None:
    router = layer.router
    assert isinstance(router, TopAnyRouter)
    shift = THRESHOLD_SHIFT * (layer.num_experts - 6)
    low, high = (bound + shift for bound in FAMILY_THRESHOLD_RANGE.get(family, THRESHOLD_RANGE))
    with torch.no_grad():
        router.threshold.copy_(torch.linspace(low, high, layer.num_experts, dtype=torch.float64))


def imported_model(case: Case, seed: int = 0):
    """The case's imported model in eval mode: a removal in the first MoE layer, an addition in the last."""
    model = randomize(tiny_model(case.family, VOCAB, seed, **OVERRIDES.get(case.family, {})).to(case.dtype), seed=seed)
    import_moe(model, case.moe())
    layers = [layer for _, layer in find_moe_layers(model)]
    layers[0].experts.keep(KEEP)
    layers[0].router.resize(KEEP, layers[0].router.weight.new_zeros(0, layers[0].config.dim))
    grow(layers[-1], torch.Generator().manual_seed(seed + 1))
    if case.router == "top_any":
        for layer in layers:
            spread_thresholds(layer, case.family)
    return model.eval()


def export_case(directory: Path, case: Case):
    """Write the case's directory; return the dynmoe_dist model it was written from."""
    model = imported_model(case)
    save_exported(model, dynmoe_section(model, case.moe(), step=7), directory)
    return model


def sample_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(seed))
