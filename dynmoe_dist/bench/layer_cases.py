"""The cases of the layer benchmark, buildable in any process from a ``CaseSpec``.

Cases, all on the same expert weights and the same tokens:
  top_any         our MoELayer with DynMoE top-any routing, thresholds calibrated to mean k = spec.k
  top_k           our MoELayer with top-k routing at the same k
  dense_limit     one FeedForward(D, F) on T x mean_k rows: the matmuls the experts must do at least
  dense_dispatch  the DynMoE authors' T x E x C one-hot dispatch (see dense_dispatch.py)
  *_grouped_mm    top_any / top_k with torch._grouped_mm instead of the per-expert loop

Shape legend: T tokens, D model dim, E experts, R routed rows.
"""

from __future__ import annotations

import ctypes
import gc
import json
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from dynmoe_dist.bench import measure
from dynmoe_dist.bench.dense_dispatch import dense_dispatch_forward
from dynmoe_dist.moe import ExpertBank, FeedForward, MoEConfig, MoELayer
from dynmoe_dist.moe.layer import TopAnyRouter
from dynmoe_dist.moe.routing import top_any

# case -> (router, expert_compute) of the MoELayer it runs; dense_limit runs no MoELayer.
CASES: Dict[str, Optional[Tuple[str, str]]] = {
    "top_any": ("top_any", "auto"),
    "top_k": ("top_k", "auto"),
    "top_any_grouped_mm": ("top_any", "grouped_mm"),
    "top_k_grouped_mm": ("top_k", "grouped_mm"),
    "dense_dispatch": ("top_any", "auto"),
    "dense_limit": None,
}
CALIBRATION_STEPS = 60
MEMORY_WARMUP_TOKENS = 64


@dataclass(frozen=True)
class CaseSpec:
    """Everything a (possibly fresh) process needs to rebuild one case identically."""

    case: str
    tokens: int
    dim: int = 256
    ffn_dim: int = 512
    num_experts: int = 8
    k: int = 2
    seed: int = 0
    threads: int = 1


# -- building the cases ---------------------------------------------------------------------------
def build_layer(spec: CaseSpec, router: str, expert_compute: str = "auto") -> MoELayer:
    """An MoELayer in training mode whose experts depend on the seed only, not on the router type."""
    config = MoEConfig(
        dim=spec.dim,
        ffn_dim=spec.ffn_dim,
        num_experts=spec.num_experts,
        router=router,
        top_k=spec.k,
        expert_compute=expert_compute,
        preset="paper",  # docs/benchmarks.md times top-any with the reference's four aux losses
    )
    torch.manual_seed(spec.seed)
    experts = ExpertBank.fresh(config, spec.num_experts)
    torch.manual_seed(spec.seed + 1)
    return MoELayer(config, experts=experts).train()


def make_tokens(spec: CaseSpec, num_rows: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs that require grad, a fixed output gradient), reproducible from the seed."""
    generator = torch.Generator().manual_seed(spec.seed + 2)
    rows = spec.tokens if num_rows is None else num_rows
    x_TD = torch.randn(rows, spec.dim, generator=generator)
    grad_TD = torch.randn(rows, spec.dim, generator=generator)
    return x_TD.requires_grad_(True), grad_TD


def top_any_router(layer: MoELayer) -> TopAnyRouter:
    router = layer.router
    assert isinstance(router, TopAnyRouter), "threshold calibration needs a layer built with router='top_any'"
    return router


def selected_count(layer: MoELayer, x_TD: torch.Tensor, shared_threshold: float) -> int:
    router = top_any_router(layer)
    threshold_E = torch.full_like(router.threshold, shared_threshold)
    routing = top_any(x_TD, router.weight, threshold_E, training=True, train_k0=layer.config.train_k0)
    return int(routing.mask.sum())  # NOTE: device-to-host sync


@torch.no_grad()
def calibrate_top_any(layer: MoELayer, x_TD: torch.Tensor, mean_k: float) -> float:
    """Bisect one threshold value shared by all experts until the layer selects round(mean_k * T)
    pairs on ``x_TD``; sets it and returns the achieved mean k. The count is taken from the real
    router, so the fp32 sigmoid comparison, not an idealised cosine test, decides it."""
    num_tokens = x_TD.shape[0]
    target = round(mean_k * num_tokens)
    low, high = -1.0, 1.0  # cosines lie in [-1, 1]: low selects everything, high nothing
    for _ in range(CALIBRATION_STEPS):
        middle = (low + high) / 2
        if selected_count(layer, x_TD, middle) > target:
            low = middle
        else:
            high = middle
    best = min((low, high), key=lambda g: abs(selected_count(layer, x_TD, g) - target))
    top_any_router(layer).threshold.fill_(best)
    return selected_count(layer, x_TD, best) / num_tokens


def moe_step(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor, forward=None) -> Callable[[], None]:
    """One training forward+backward (output gradient fixed, aux loss included), grads reset first."""
    forward = forward or (lambda: _layer_forward(layer, x_TD))
    params = [*layer.parameters(), x_TD]

    def step() -> None:
        for p in params:
            p.grad = None
        out_TD, aux = forward()
        torch.autograd.backward([out_TD, aux], [grad_TD, torch.ones_like(aux)])

    return step


def _layer_forward(layer: MoELayer, x_TD: torch.Tensor):
    out = layer(x_TD)
    return out.output, out.aux_loss


def dense_limit_step(spec: CaseSpec, num_rows: int) -> Callable[[], None]:
    """The physical limit: one dense FeedForward(D, F) forward+backward on all routed rows at once."""
    torch.manual_seed(spec.seed)
    block = FeedForward(spec.dim, spec.ffn_dim)
    rows_RD, grad_RD = make_tokens(spec, num_rows)
    params = [*block.parameters(), rows_RD]

    def step() -> None:
        for p in params:
            p.grad = None
        block(rows_RD).backward(grad_RD)

    return step


def build_case(spec: CaseSpec, num_rows: Optional[int] = None) -> Tuple[Callable[[], None], dict]:
    """(step, facts about the case). ``num_rows`` sizes dense_limit (T x achieved mean k)."""
    if spec.case not in CASES:
        raise ValueError(f"case ({spec.case!r}) must be one of {tuple(CASES)}")
    if spec.case == "dense_limit":
        num_rows = num_rows if num_rows is not None else round(spec.k * spec.tokens)
        return dense_limit_step(spec, num_rows), {"rows": num_rows}
    case = CASES[spec.case]
    assert case is not None, "only dense_limit runs no MoELayer"
    router, expert_compute = case
    layer = build_layer(spec, router, expert_compute)
    x_TD, grad_TD = make_tokens(spec)
    info = {"mean_k": calibrate_top_any(layer, x_TD, spec.k) if router == "top_any" else float(spec.k)}
    with torch.no_grad():
        counts_E = layer(x_TD).routing.mask.sum(dim=0)
    info["max_expert_rows"] = int(counts_E.max())  # NOTE: device-to-host sync (setup, untimed)
    if spec.case == "dense_dispatch":
        forward = lambda: dense_dispatch_forward(layer, x_TD)[:2]  # noqa: E731
        return moe_step(layer, x_TD, grad_TD, forward), info
    return moe_step(layer, x_TD, grad_TD), info


# -- the reference check ------------------------------------------------------------------------------
def check_reference(spec: CaseSpec) -> dict:
    """Our MoELayer and the dense dispatch must compute the same output and input gradient on the
    same weights and tokens (once, untimed): otherwise the speed comparison would mean nothing."""
    layer = build_layer(spec, "top_any")
    x_TD, grad_TD = make_tokens(spec)
    calibrate_top_any(layer, x_TD, spec.k)
    ours = _output_and_input_grad(lambda: _layer_forward(layer, x_TD), x_TD, grad_TD)
    reference = _output_and_input_grad(lambda: dense_dispatch_forward(layer, x_TD)[:2], x_TD, grad_TD)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    # NOTE: device-to-host sync (the untimed reference check)
    return {
        "tokens": spec.tokens,
        "output_max_abs_diff": float((ours[0] - reference[0]).abs().max()),
        "input_grad_max_abs_diff": float((ours[1] - reference[1]).abs().max()),
        "passed": True,
    }


def _output_and_input_grad(forward, x_TD: torch.Tensor, grad_TD: torch.Tensor):
    x_TD.grad = None
    out_TD, _ = forward()
    out_TD.backward(grad_TD)
    assert x_TD.grad is not None, "x_TD requires grad, so backward filled it"
    return out_TD.detach(), x_TD.grad.clone()


# -- memory, in a fresh process per case --------------------------------------------------------------
def memory_child(spec_dict: dict) -> None:
    """Entry point of the fresh process: prints {"peak_mb": ...} for one case."""
    num_rows = spec_dict.pop("rows", None)
    spec = CaseSpec(**spec_dict)
    torch.set_num_threads(spec.threads)
    tiny_step, _ = build_case(
        replace(spec, tokens=MEMORY_WARMUP_TOKENS), None if num_rows is None else MEMORY_WARMUP_TOKENS * spec.k
    )
    tiny_step()
    tiny_step()
    step, _ = build_case(spec, num_rows)
    del tiny_step
    _release_free_memory()
    print(json.dumps({"peak_mb": measure.peak_rss_above_baseline_mb(step)}))


def _release_free_memory() -> None:
    """Hand freed heap back to the OS, so the step cannot silently reuse memory counted in the
    baseline (which would understate its peak)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_mb(spec: CaseSpec, num_rows: Optional[int] = None) -> Optional[float]:
    if not measure.memory_supported():
        return None
    payload = {**asdict(spec), **({"rows": num_rows} if num_rows is not None else {})}
    result = measure.run_in_fresh_process(
        "dynmoe_dist.bench.layer_cases:memory_child", payload, extra_env=measure.MEMORY_PROCESS_ENV
    )
    return result["peak_mb"]
