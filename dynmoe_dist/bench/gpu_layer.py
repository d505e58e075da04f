"""gpu-check sections on one MoE layer: correctness on CUDA against the CPU float64 reference, the
grouped matmul against the per-expert loop, and bf16 throughput against a dense FFN.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts.

Correctness compares output, input gradient and every parameter gradient with an error bound
relative to the reference's magnitude (fp32 1e-5, bf16 2e-2). Under bf16 autocast the router's
cosine matmul runs in bf16, which can flip a selection near its threshold and change a token's
output by a whole expert: tokens are therefore drawn away from every decision boundary (by the
float64 reference scores), so that a mismatch means a wrong kernel, not a tie broken differently.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Dict, List, Tuple, TypedDict

import torch

from dynmoe_dist.bench import layer_cases
from dynmoe_dist.moe import FeedForward, MoEConfig, MoELayer

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
MARGIN = 0.03  # distance from every routing decision boundary, in cosine (top_any) or probability units
ROUTERS = ("top_any", "top_k", "top_p")


# -- correctness ---------------------------------------------------------------------------------------
def reference_layer(router: str, num_experts: int = 8, dim: int = 32, ffn_dim: int = 48, seed: int = 0):
    """A float64 CPU layer; top_any's last expert has an unreachable threshold (an expert with no rows)."""
    torch.manual_seed(seed)
    config = MoEConfig(
        dim=dim,
        ffn_dim=ffn_dim,
        num_experts=num_experts,
        router=router,
        top_k=2,
        top_p=0.4,
        threshold_init=0.2,
        preset="paper",  # all four aux losses: the most code under test
    )
    layer = MoELayer(config).double().train()
    with torch.no_grad():
        # Away from the orthogonal init: there the diverse loss ||Wn Wn^T - I||_F is ~0 and its gradient
        # (A / ||A||) is the direction of fp32 rounding noise, which no precision comparison survives.
        layer.router.weight.add_(0.2 * torch.randn_like(layer.router.weight))
        if router == "top_any":
            layer_cases.top_any_router(layer).threshold[-1] = 2.0  # cosines never exceed 1: an expert with no rows
    return layer


def _far_from_boundaries(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """bool (T,): tokens whose routing does not change under a perturbation of MARGIN."""
    with torch.no_grad():
        routing = layer.router(x_TD, True)
        probs_TE = routing.probs
        if layer.config.router == "top_any":
            cos_TE = torch.logit(probs_TE)  # scale 1: sigmoid(cos)
            return ((cos_TE - layer_cases.top_any_router(layer).threshold).abs() > MARGIN).all(dim=-1)
        sorted_TE = probs_TE.sort(dim=-1, descending=True).values
        if layer.config.router == "top_k":
            k = layer.config.top_k
            return sorted_TE[:, k - 1] - sorted_TE[:, k] > MARGIN
        mass_before_TE = sorted_TE.cumsum(dim=-1) - sorted_TE
        return ((mass_before_TE - layer.config.top_p).abs() > MARGIN).all(dim=-1)


def routed_tokens(layer: MoELayer, num_tokens: int, seed: int) -> torch.Tensor:
    """num_tokens float64 tokens away from the routing boundaries (drawn in batches and filtered)."""
    g = torch.Generator().manual_seed(seed)
    kept: List[torch.Tensor] = []
    while sum(t.shape[0] for t in kept) < num_tokens:
        x_TD = torch.randn(4 * num_tokens + 16, layer.config.dim, generator=g, dtype=torch.float64)
        kept.append(x_TD[_far_from_boundaries(layer, x_TD)])  # NOTE: device-to-host sync (test setup, CPU)
    return torch.cat(kept)[:num_tokens]


def _run(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor, bf16: bool):
    x_TD = x_TD.detach().requires_grad_(True)
    with torch.autocast(x_TD.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = layer(x_TD)
    # The layer returns its input's dtype (fp32 here) also under autocast.
    torch.autograd.backward([out.output, out.aux_loss], [grad_TD.to(out.output.dtype), torch.ones_like(out.aux_loss)])
    named = {"output": out.output.detach(), "input_grad": x_TD.grad}
    named.update({f"grad {n}": p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return {k: v.detach().double().cpu() for k, v in named.items()}, out.routing  # NOTE: device-to-host sync


def compare(mine: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], tol: float) -> Dict:
    worst, worst_name = 0.0, ""
    missing = sorted(set(ref) ^ set(mine))
    for name, r in ref.items():
        if name not in mine or r.numel() == 0:
            continue
        err = float((mine[name] - r).abs().max()) / max(1.0, float(r.abs().max()))
        if err > worst:
            worst, worst_name = err, name
    return {"max_rel_err": worst, "worst": worst_name, "missing": missing, "passed": worst <= tol and not missing}


def check_router(router: str, num_tokens: int, precision: str, device: str = "cuda") -> Dict:
    ref_layer = reference_layer(router)
    x_TD = routed_tokens(ref_layer, num_tokens, seed=num_tokens)
    grad_TD = torch.randn(x_TD.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    device_layer = copy.deepcopy(ref_layer).float().to(device)
    ref, ref_routing = _run(ref_layer, x_TD, grad_TD, bf16=False)
    mine, routing = _run(device_layer, x_TD.float().to(device), grad_TD.float().to(device), bf16=precision == "bf16")
    result = compare(mine, ref, TOLERANCE[precision])
    k_T, counts_E = ref_routing.num_selected, ref_routing.mask.sum(dim=0)
    flips = int((routing.mask.cpu() != ref_routing.mask).any(dim=-1).sum())  # NOTE: device-to-host sync
    result.update(
        router=router,
        precision=precision,
        tokens=num_tokens,
        routing_flips=flips,
        k0_tokens=int((k_T == 0).sum()),
        empty_experts=int((counts_E == 0).sum()),
    )
    result["passed"] = result["passed"] and flips == 0
    return result


def layer_correctness(context: dict) -> Dict:
    cases = [
        check_router(router, tokens, precision, context["device"])
        for router in ROUTERS
        for tokens in (6, 256)
        for precision in ("fp32", "bf16")
    ]
    failed = [c for c in cases if not c["passed"]]
    k0 = sum(c["k0_tokens"] for c in cases)
    empty = sum(c["empty_experts"] > 0 for c in cases)
    worst = max(cases, key=lambda c: c["max_rel_err"] / TOLERANCE[c["precision"]])
    return {
        "passed": not failed,
        "cases": cases,
        "failed": [f"{c['router']} T={c['tokens']} {c['precision']}" for c in failed],
        "summary": f"{len(cases) - len(failed)}/{len(cases)} cases within tolerance; {k0} k=0 tokens, "
        f"{empty} cases with empty experts; worst {worst['router']} {worst['precision']} "
        f"rel err {worst['max_rel_err']:.2e}",
    }


# -- grouped matmul vs the per-expert loop ---------------------------------------------------------------
def grouped_vs_loop(context: dict) -> Dict:
    """Both expert paths against the float64 reference (two bf16 computations differ from each other by
    up to twice the error of either, so each is held to the reference's bound; their mutual difference
    is reported)."""
    results: List[Dict[str, Any]] = []  # per precision, JSON
    device = context["device"]
    ref_layer = reference_layer("top_k", num_experts=8, dim=64, ffn_dim=128)
    x_TD = routed_tokens(ref_layer, 512, seed=3)
    grad_TD = torch.randn(x_TD.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    reference, _ = _run(ref_layer, x_TD, grad_TD, bf16=False)
    for precision in ("bf16", "fp32"):
        runs = {}
        for mode in ("loop", "grouped_mm"):
            layer = copy.deepcopy(ref_layer).float().to(device)
            layer.experts.config = replace(layer.experts.config, expert_compute=mode)
            try:
                runs[mode], _ = _run(layer, x_TD.float().to(device), grad_TD.float().to(device), precision == "bf16")
            except RuntimeError as error:  # torch._grouped_mm takes fp32 only on some GPUs
                runs[mode] = str(error).splitlines()[0]
        if isinstance(runs["grouped_mm"], str):
            results.append({"precision": precision, "unsupported": runs["grouped_mm"], "passed": precision != "bf16"})
            continue
        tol = TOLERANCE[precision]
        grouped, loop = compare(runs["grouped_mm"], reference, tol), compare(runs["loop"], reference, tol)
        results.append(
            {
                "precision": precision,
                "grouped_mm": grouped,
                "loop": loop,
                "grouped_vs_loop_rel_err": compare(runs["grouped_mm"], runs["loop"], tol)["max_rel_err"],
                "passed": grouped["passed"] and loop["passed"],
            }
        )
    text = "; ".join(
        f"{r['precision']}: "
        + (
            f"grouped_mm unsupported ({r['unsupported'][:60]})"
            if "unsupported" in r
            else f"rel err vs float64 grouped {r['grouped_mm']['max_rel_err']:.1e}, loop {r['loop']['max_rel_err']:.1e}"
        )
        for r in results
    )
    return {"passed": all(r["passed"] for r in results), "cases": results, "summary": text}


# -- bf16 throughput -------------------------------------------------------------------------------------
class ThroughputShape(TypedDict):
    dim: int
    ffn_dim: int
    tokens: int
    k: int
    experts: Tuple[int, ...]
    """One throughput case per expert count."""


THROUGHPUT_SHAPE: ThroughputShape = {"dim": 2048, "ffn_dim": 5632, "tokens": 16384, "k": 2, "experts": (8, 64)}
REHEARSAL_SHAPE: ThroughputShape = {"dim": 32, "ffn_dim": 64, "tokens": 256, "k": 2, "experts": (4, 8)}
TARGETS = {"moe_vs_dense_tokens_per_s": (">=", 0.8), "top_any_vs_top_k_time": ("<=", 1.05)}


def _timed_ms(step, device: str, warmup: int = 2, repeats: int = 5) -> Dict:
    if device != "cuda":
        return _timed_ms_host(step, warmup, repeats)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return {
        "ms_median": round(sorted(times)[len(times) // 2], 3),
        "ms_min": round(min(times), 3),
        "peak_mb_above_baseline": round(peak, 1),
    }


def _timed_ms_host(step, warmup: int, repeats: int) -> Dict:
    """The rehearsal on CPU: wall-clock time, no device memory figure."""
    import time

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {
        "ms_median": round(sorted(times)[len(times) // 2], 3),
        "ms_min": round(min(times), 3),
        "peak_mb_above_baseline": None,
    }


def _bf16(step, device: str):
    def wrapped():
        with torch.autocast(device, dtype=torch.bfloat16):
            step()

    return wrapped


def throughput_case(num_experts: int, shape: ThroughputShape, device: str) -> Dict:
    spec = layer_cases.CaseSpec(
        case="top_k",
        tokens=shape["tokens"],
        dim=shape["dim"],
        ffn_dim=shape["ffn_dim"],
        num_experts=num_experts,
        k=shape["k"],
    )
    with torch.device(device):
        layer = layer_cases.build_layer(spec, "top_k")
        any_layer = MoELayer(replace(layer.config, router="top_any"), experts=layer.experts).train()
        dense = FeedForward(spec.dim, spec.k * spec.ffn_dim)  # the active parameters of k experts
        x_TD = torch.randn(spec.tokens, spec.dim).requires_grad_(True)
        grad_TD = torch.randn(spec.tokens, spec.dim)
    mean_k = layer_cases.calibrate_top_any(any_layer, x_TD.detach(), spec.k)
    dense_params = [*dense.parameters(), x_TD]

    def dense_step():
        for p in dense_params:
            p.grad = None
        dense(x_TD).backward(grad_TD)

    cases = {
        "top_k": _timed_ms(_bf16(layer_cases.moe_step(layer, x_TD, grad_TD), device), device),
        "top_any": _timed_ms(_bf16(layer_cases.moe_step(any_layer, x_TD, grad_TD), device), device),
        "dense_ffn": _timed_ms(_bf16(dense_step, device), device),
    }
    for timing in cases.values():
        timing["tokens_per_s"] = round(spec.tokens / (timing["ms_median"] / 1e3))
    ratios = {
        "moe_vs_dense_tokens_per_s": cases["top_k"]["tokens_per_s"] / cases["dense_ffn"]["tokens_per_s"],
        "top_any_vs_top_k_time": cases["top_any"]["ms_median"] / cases["top_k"]["ms_median"],
    }
    met = {
        name: (value >= TARGETS[name][1]) if TARGETS[name][0] == ">=" else (value <= TARGETS[name][1])
        for name, value in ratios.items()
    }
    return {
        "experts": num_experts,
        "top_any_mean_k": round(mean_k, 4),
        "cases": cases,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets_met": met,
    }


def throughput(context: dict) -> Dict:
    shape = REHEARSAL_SHAPE if context.get("rehearsal") else THROUGHPUT_SHAPE
    results = [throughput_case(e, shape, context["device"]) for e in shape["experts"]]
    text = "; ".join(
        f"E={r['experts']}: MoE/dense {r['ratios']['moe_vs_dense_tokens_per_s']:.2f}x tokens/s, "
        f"top-any/top-k {r['ratios']['top_any_vs_top_k_time']:.2f}x time"
        for r in results
    )
    return {
        "shape": shape,
        "precision": "bf16 autocast, fp32 master weights",
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "results": results,
        "all_targets_met": all(all(r["targets_met"].values()) for r in results),
        "summary": text,
    }
