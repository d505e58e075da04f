"""`python -m dynmoe_dist.bench layer`: forward+backward time and peak memory of one MoE layer.

Compares, at one shape (T = 4096, D = 256, F = 512, E = 8 by default):
  top_any vs top_k at the same mean number of selected experts (is dynamic routing free?),
  top_any vs one dense FeedForward on T x mean_k rows (the physical limit of the expert matmuls),
  top_any vs the DynMoE authors' dense T x E x C dispatch (time and peak memory),
  the per-expert loop vs torch._grouped_mm for the expert matmuls,
then tabulates how top_any, the dense limit and the dense dispatch grow with T, and splits top_any's and
top_k's steps into router, losses, dispatch and experts at several sizes (layer_split.py).

Prints one JSON object with the figures, the method, the issue's targets and whether each is met.
Timing is never asserted: this is a benchmark, not a test. The cases live in layer_cases.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from typing import Any, Dict, List, Optional

import torch

from dynmoe_dist.bench import measure
from dynmoe_dist.bench.dense_dispatch import dense_dispatch_bytes
from dynmoe_dist.bench.layer_cases import CaseSpec, build_case, check_reference, peak_memory_mb
from dynmoe_dist.bench.layer_split import DEFAULT_SIZES, parse_sizes, run_split

HEADLINE_CASES = ("top_any", "top_k", "dense_limit", "dense_dispatch", "top_any_grouped_mm", "top_k_grouped_mm")
MEMORY_CASES = ("top_any", "top_k", "dense_limit", "dense_dispatch")
SCALING_CASES = ("top_any", "dense_limit", "dense_dispatch")
TARGETS = {
    "top_any_vs_top_k": ("top_any / top_k time at equal mean k", "<=", 1.05),
    "layer_vs_dense_limit": ("top_any / dense_limit time", "<=", 1.2),
    "speedup_vs_dense_dispatch": ("dense_dispatch / top_any time", ">=", 8.0),
    "memory_vs_dense_dispatch": ("dense_dispatch / top_any peak memory above baseline", ">=", 8.0),
    "top_any_vs_top_k_every_size": ("the largest top_any / top_k whole-step time of the split's sizes", "<=", 1.02),
}
# The dense dispatch may use at most this share of the memory available when it starts.
DISPATCH_MEMORY_SHARE = 0.5


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench layer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", type=int, default=4096, help="T, tokens per step")
    parser.add_argument("--dim", type=int, default=256, help="D, model dimension")
    parser.add_argument("--ffn-dim", type=int, default=512, help="F, expert hidden dimension")
    parser.add_argument("--experts", type=int, default=8, help="E, number of experts")
    parser.add_argument("--k", type=int, default=2, help="top_k's k and top_any's calibrated mean k")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds at the headline shape")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before timing")
    parser.add_argument(
        "--scaling",
        default="512,1024,2048,4096,8192",
        help="comma-separated T values for the scaling table ('' skips it)",
    )
    parser.add_argument("--scaling-repeats", type=int, default=3, help="timed rounds per scaling row")
    parser.add_argument(
        "--dispatch-max-tokens",
        type=int,
        default=8192,
        help="largest T at which the dense dispatch runs (it grows with T squared)",
    )
    parser.add_argument(
        "--split-sizes",
        default=DEFAULT_SIZES,
        help="comma-separated TxDxFxE sizes at which top_any and top_k are split into phases ('' skips it)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory processes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.split_sizes = parse_sizes(args.split_sizes)
    for _, _, _, experts in [(0, 0, 0, args.experts), *args.split_sizes]:
        if args.k > experts or args.k < 1:
            raise ValueError(f"--k ({args.k}) must be in [1, the experts ({experts})] of every size")
    return args


def base_spec(args: argparse.Namespace, case: str, tokens: int) -> CaseSpec:
    return CaseSpec(
        case=case,
        tokens=tokens,
        dim=args.dim,
        ffn_dim=args.ffn_dim,
        num_experts=args.experts,
        k=args.k,
        seed=args.seed,
        threads=args.threads,
    )


# -- the headline shape -------------------------------------------------------------------------------
def run_headline(args: argparse.Namespace) -> Dict[str, dict]:
    steps, cases = _build_steps(args, HEADLINE_CASES, args.tokens)
    for name, timing in measure.time_interleaved(steps, repeats=args.repeats, warmup=args.warmup).items():
        cases[name].update(timing)
    del steps
    for name in MEMORY_CASES if not args.no_memory else ():
        cases[name]["peak_mb"] = peak_memory_mb(base_spec(args, name, args.tokens), cases[name].get("rows"))
    return cases


def _build_steps(args: argparse.Namespace, names, tokens: int, skip_dispatch: bool = False):
    """Build every case at one T. dense_limit gets T x (top_any's achieved mean k) rows, so that the
    limit does exactly the matmuls the layer does; the dense dispatch's capacity is top_any's
    largest expert count (same routing, same weights)."""
    steps, cases = {}, {}
    steps["top_any"], cases["top_any"] = build_case(base_spec(args, "top_any", tokens))
    routed_rows = round(cases["top_any"]["mean_k"] * tokens)
    for name in names:
        if name == "top_any" or (name == "dense_dispatch" and skip_dispatch):
            continue
        steps[name], cases[name] = build_case(base_spec(args, name, tokens), routed_rows)
    if "dense_dispatch" in cases:
        cases["dense_dispatch"]["capacity"] = cases["dense_dispatch"].pop("max_expert_rows")
    return {name: steps[name] for name in names if name in steps}, cases


def evaluate_targets(cases: Dict[str, dict], split: Optional[dict] = None) -> Dict[str, dict]:
    """Every ratio from the minimum times (the least disturbed by other load); medians shown too."""
    ratios = {
        "top_any_vs_top_k_every_size": None if split is None else split["worst_whole_ratio"],
        "top_any_vs_top_k": _ratio(cases, "top_any", "top_k", "ms_min"),
        "layer_vs_dense_limit": _ratio(cases, "top_any", "dense_limit", "ms_min"),
        "speedup_vs_dense_dispatch": _ratio(cases, "dense_dispatch", "top_any", "ms_min"),
        "memory_vs_dense_dispatch": _ratio(cases, "dense_dispatch", "top_any", "peak_mb"),
    }
    medians = {
        "top_any_vs_top_k": _ratio(cases, "top_any", "top_k", "ms_median"),
        "layer_vs_dense_limit": _ratio(cases, "top_any", "dense_limit", "ms_median"),
        "speedup_vs_dense_dispatch": _ratio(cases, "dense_dispatch", "top_any", "ms_median"),
    }
    report = {}
    for name, (what, sense, bound) in TARGETS.items():
        value = ratios[name]
        met = None if value is None else (value <= bound if sense == "<=" else value >= bound)
        report[name] = {"measures": what, "target": f"{sense} {bound}", "value": value, "met": met}
        if name in medians:
            report[name]["value_from_medians"] = medians[name]
    return report


def _ratio(cases: Dict[str, dict], top: str, bottom: str, field: str) -> Optional[float]:
    numerator, denominator = cases[top].get(field), cases[bottom].get(field)
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def expert_compute_comparison(cases: Dict[str, dict]) -> dict:
    """Per-expert loop ('auto' on CPU) vs torch._grouped_mm, same routing and weights."""
    return {
        router: {
            "loop_ms_min": cases[router]["ms_min"],
            "grouped_mm_ms_min": cases[f"{router}_grouped_mm"]["ms_min"],
            "grouped_mm_over_loop": _ratio(cases, f"{router}_grouped_mm", router, "ms_min"),
        }
        for router in ("top_any", "top_k")
    }


# -- the scaling table --------------------------------------------------------------------------------
def run_scaling(args: argparse.Namespace, token_counts: List[int]) -> dict:
    rows = [_scaling_row(args, tokens) for tokens in token_counts]
    return {
        "tokens": token_counts,
        "repeats": args.scaling_repeats,
        "rows": rows,
        "growth_exponent_last_doubling": _growth(rows),
        "dense_dispatch_cap": (
            f"runs while T <= {args.dispatch_max_tokens} and its T x E x C tensors fit in "
            f"{DISPATCH_MEMORY_SHARE:.0%} of available memory; larger T is skipped"
        ),
    }


def _scaling_row(args: argparse.Namespace, tokens: int) -> dict:
    skip_reason = _dispatch_skip_reason(args, tokens)
    steps, cases = _build_steps(args, SCALING_CASES, tokens, skip_dispatch=skip_reason is not None)
    timings = measure.time_interleaved(steps, repeats=args.scaling_repeats, warmup=1)
    del steps
    row: Dict[str, Any] = {"tokens": tokens}  # a JSON row: case name -> its timings
    for name in SCALING_CASES:
        if name not in timings:
            row[name] = {"skipped": skip_reason}
            continue
        row[name] = {"ms_min": timings[name]["ms_min"], "ms_median": timings[name]["ms_median"]}
        if not args.no_memory:
            row[name]["peak_mb"] = peak_memory_mb(base_spec(args, name, tokens), cases[name].get("rows"))
    row["dense_dispatch"]["capacity"] = cases["top_any"]["max_expert_rows"]
    return row


def _dispatch_skip_reason(args: argparse.Namespace, tokens: int) -> Optional[str]:
    if tokens > args.dispatch_max_tokens:
        return f"T ({tokens}) > --dispatch-max-tokens ({args.dispatch_max_tokens})"
    # Capacity is about T k / E under balanced routing; allow a quarter more for imbalance.
    capacity = math.ceil(1.25 * tokens * args.k / args.experts)
    needed_mb = dense_dispatch_bytes(tokens, args.experts, capacity) / 2**20
    available_mb = measure.available_memory_mb()
    if available_mb is not None and needed_mb > DISPATCH_MEMORY_SHARE * available_mb:
        return f"needs about {needed_mb:.0f} MiB, available {available_mb:.0f} MiB"
    return None


def _growth(rows: List[dict]) -> Dict[str, dict]:
    """log2(figure at T / figure at T/2) for the two largest measured T: 1 is linear, 2 quadratic."""
    growth = {}
    for name in SCALING_CASES:
        measured = [row for row in rows if "ms_min" in row[name]]
        if len(measured) < 2:
            continue
        before, last = measured[-2], measured[-1]
        doublings = math.log2(last["tokens"] / before["tokens"])
        growth[name] = {
            field: round(math.log2(last[name][field] / before[name][field]) / doublings, 2)
            for field in ("ms_min", "peak_mb")
            if last[name].get(field) and before[name].get(field)
        }
    return growth


# -- entry point --------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(list(argv or []))
    torch.set_num_threads(args.threads)
    result = {
        "benchmark": "layer",
        "command": " ".join(["python -m dynmoe_dist.bench layer", *map(shlex.quote, argv or [])]),
        "machine": measure.machine_info(args.threads),
        "shape": {
            "tokens": args.tokens,
            "dim": args.dim,
            "ffn_dim": args.ffn_dim,
            "num_experts": args.experts,
            "k": args.k,
        },
        "timing_method": (
            f"forward+backward of one training step (fixed output gradient, aux loss "
            f"included, grads reset to None each step); cases timed round-robin, "
            f"{args.warmup} warm-up rounds then {args.repeats} timed; ms_min and ms_median "
            f"over the rounds; ratios use ms_min"
        ),
        "memory_method": measure.MEMORY_METHOD if measure.memory_supported() else "unsupported here",
        "calibration": "top_any: bisection on one threshold shared by all experts until the router "
        "selects round(k T) pairs; mean_k is what it achieved",
        "reference_check": check_reference(base_spec(args, "dense_dispatch", args.tokens)),
    }
    cases = run_headline(args)
    result["cases"] = cases
    result["expert_compute"] = expert_compute_comparison(cases)
    split = None
    if args.split_sizes:
        split = result["split"] = run_split(
            base_spec(args, "top_any", args.tokens), args.split_sizes, args.repeats, args.warmup
        )
    result["targets"] = evaluate_targets(cases, split)
    token_counts = [int(t) for t in args.scaling.split(",") if t.strip()]
    if token_counts:
        result["scaling"] = run_scaling(args, token_counts)
    print(json.dumps(result, indent=2))
    return result
