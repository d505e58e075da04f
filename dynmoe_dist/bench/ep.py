"""`python -m dynmoe_dist.bench ep`: our expert-parallel MoE step against fairscale and against its limit.

On a simulated gloo cluster (default 2 ranks, one torch thread each; D = 256, F = 1024, 4 experts per
rank, 4096 tokens per rank), every rank times forward + backward of:
  ours_top2       our MoELayer, top-2 router, dropless all-to-all dispatch;
  fairscale_top2  fairscale's MOELayer + Top2Gate (capacity 2T/E, dense einsum dispatch), same weights;
  ours_top_any    our MoELayer with DynMoE top-any routing, thresholds calibrated to top-2's mean k;
  limit_experts   the expert matmuls (forward + backward) on exactly the rows this rank received;
  limit_a2a       the step's four all_to_all_single calls (dispatch, combine, and their mirrors), bare.
limit = limit_experts + limit_a2a. Contenders run round-robin, each after a barrier, and the order
rotates every round, so background load and the after-effects of the previous contender hit them alike.
A round's step time is the max over ranks (the slowest rank finishes the step); the JSON reports min and
median over rounds of wall time, of CPU time (this rank's process, all threads), and every rank's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Tuple

import torch

from ..parallel.groups import barrier, build_groups
from ..parallel.simulate import run_simulated
from . import ep_parts as parts

TARGETS = {"vs_fairscale": 0.2, "top_any_vs_top_k": 1.05, "vs_limit": 1.3}


# -- one rank ----------------------------------------------------------------------------------------
def layer_step(layer, x_TD, cot_TD) -> Callable[[], None]:
    def run() -> None:
        x = x_TD.detach().requires_grad_()
        res = layer(x)
        ((res.output * cot_TD).sum() + res.aux_loss).backward()

    return run


def fairscale_step(layer, x_TD, cot_TD, num_local: int) -> Callable[[], None]:
    def run() -> None:
        x = parts.fairscale_input(x_TD.detach(), num_local).requires_grad_()
        out = layer(x)
        ((out.reshape(cot_TD.shape) * cot_TD).sum() + layer.l_aux).backward()

    return run


def timed(fn: Callable[[], None], groups) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of this rank's process). Wall time is the figure; CPU time (all
    threads, gloo's included; blocked waits excluded) shows the work done, which background load on a
    shared machine inflates far less than it inflates wall time."""
    barrier(groups, "bench start", groups.ep_group)  # every contender starts together on every rank
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def our_bytes(layer, x_TD) -> Dict:
    """One counted forward pass of our layer: bytes its dispatcher sent against its routed rows."""
    layer.dispatcher.comm.reset()
    with torch.no_grad():
        routed = int(layer(x_TD).routing.mask.sum())  # NOTE: device-to-host sync (setup, untimed)
    comm = layer.dispatcher.comm
    return {
        "routed_rows": routed,
        "bytes_per_direction": comm.bytes_sent,
        "remote_bytes_per_direction": comm.remote_bytes_sent,
        "bytes_equal_routed_rows": comm.bytes_sent == routed * x_TD.shape[1] * x_TD.element_size(),
        # forward dispatch + combine, and the same two exchanges again in backward
        "bytes_per_step": 4 * comm.bytes_sent,
    }


def fairscale_bytes(fs, x_TD, shapes: parts.Shapes, world: int) -> Dict:
    """fairscale sends its whole E x C x D buffer each way, however many pairs it kept."""
    num_experts = shapes.num_experts(world)
    per_direction = parts.fairscale_bytes_per_direction(x_TD.shape[0], num_experts, shapes.dim, x_TD.element_size())
    kept = parts.fairscale_kept_pairs(fs, x_TD)
    return {
        "bytes_per_direction": per_direction,
        "remote_bytes_per_direction": per_direction * (world - 1) // world,
        "bytes_per_step": 4 * per_direction,
        "capacity": parts.fairscale_capacity(x_TD.shape[0], num_experts),
        "kept_pairs": kept,
        "dropped_pairs": 2 * x_TD.shape[0] - kept,
    }


def pin_to_core(rank: int, pin: bool) -> None:
    """One core per rank (when asked and the OS allows): ranks do not share a core with each other."""
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def rank_worker(shapes_dict: Dict, warmup: int, repeats: int, pin: bool = False) -> Dict:
    shapes = parts.Shapes(**shapes_dict)
    groups = build_groups(0)
    pin_to_core(groups.rank, pin)
    gen = torch.Generator().manual_seed(1000 + groups.rank)
    x_TD = torch.randn(shapes.tokens, shapes.dim, generator=gen)
    cot_TD = torch.randn(shapes.tokens, shapes.dim, generator=gen)

    top2 = parts.our_layer(shapes, groups, "top_k")
    top_any = parts.our_layer(shapes, groups, "top_any")
    parts.copy_experts(top2, top_any)
    fs = parts.fairscale_layer(top2, groups)
    mean_k_top2 = parts.global_mean_k(top2, x_TD, groups)
    threshold = parts.calibrate_threshold(top_any, x_TD, groups, mean_k_top2)
    received = parts.capture_received(top2, x_TD)
    received_any = parts.capture_received(top_any, x_TD)

    contenders = {
        "ours_top2": layer_step(top2, x_TD, cot_TD),
        "fairscale_top2": fairscale_step(fs, x_TD, cot_TD, shapes.experts_per_rank),
        "ours_top_any": layer_step(top_any, x_TD, cot_TD),
        "limit_experts": parts.expert_matmuls(list(top2.experts.experts), received.counts_e, shapes.dim, gen),
        "limit_a2a": parts.bare_all_to_alls(received, shapes.dim, groups.ep_group),
    }
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    cpu: Dict[str, List[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(warmup + repeats):
        # Rotate the order every round: what ran just before matters (fairscale frees ~1 GB of
        # buffers, and the next contender pays the page faults of fresh allocations), so every
        # contender follows every other equally often.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            fn = contenders[name]
            parts.zero_grads(top2, top_any, fs)
            wall_s, cpu_s = timed(fn, groups)
            if round_ >= warmup:
                times[name].append(wall_s)
                cpu[name].append(cpu_s)
    wire = {
        "ours_top2": our_bytes(top2, x_TD),
        "ours_top_any": our_bytes(top_any, x_TD),
        "fairscale_top2": fairscale_bytes(fs, x_TD, shapes, groups.ep_size),
    }
    return {
        "rank": groups.rank,
        "times": times,
        "cpu": cpu,
        "wire": wire,
        "received_rows_per_expert": {"ours_top2": received.counts_e, "ours_top_any": received_any.counts_e},
        "mean_k_top2": mean_k_top2,
        "mean_k_top_any": parts.global_mean_k(top_any, x_TD, groups),
        "top_any_threshold": threshold,
    }


# -- the parent: assemble ------------------------------------------------------------------------------
RATIOS = {
    "vs_fairscale": ("ours_top2", "fairscale_top2"),
    "top_any_vs_top_k": ("ours_top_any", "ours_top2"),
    "vs_limit": ("ours_top2", "limit"),
}


def step_times(per_rank: List[Dict], kind: str, name: str) -> List[float]:
    """Per round, the slowest rank's time; for the limit, the slowest rank's experts + exchanges."""
    if name == "limit":
        parts_ = [[a + b for a, b in zip(r[kind]["limit_experts"], r[kind]["limit_a2a"])] for r in per_rank]
    else:
        parts_ = [r[kind][name] for r in per_rank]
    return [max(values) for values in zip(*parts_)]


def figures(per_rank: List[Dict], kind: str) -> Dict:
    """min / median over rounds of every contender's step time, and the target ratios of both."""
    names = list(per_rank[0][kind]) + ["limit"]
    steps = {name: step_times(per_rank, kind, name) for name in names}
    stats = {name: {"min_s": min(v), "median_s": statistics.median(v)} for name, v in steps.items()}
    ratios = {}
    for key, (num, den) in RATIOS.items():
        r_min = stats[num]["min_s"] / stats[den]["min_s"]
        r_med = stats[num]["median_s"] / stats[den]["median_s"]
        ratios[key] = {
            "of": f"{num} / {den}",
            "min": r_min,
            "median": r_med,
            "target_max": TARGETS[key],
            "met_min": r_min <= TARGETS[key],
            "met_median": r_med <= TARGETS[key],
        }
    return {"step": stats, "ratios": ratios}


def per_rank_table(per_rank: List[Dict], kind: str) -> Dict:
    return {
        name: [
            {"rank": r["rank"], "min_s": min(r[kind][name]), "median_s": statistics.median(r[kind][name])}
            for r in per_rank
        ]
        for name in per_rank[0][kind]
    }


def summarise(per_rank: List[Dict], args) -> Dict:
    wall, cpu = figures(per_rank, "times"), figures(per_rank, "cpu")
    wire = [r["wire"] for r in per_rank]
    return {
        "benchmark": "ep",
        "setup": {
            "ranks": args.ranks,
            "backend": "gloo",
            "torch_threads_per_rank": 1,
            "dim": args.dim,
            "ffn_dim": args.ffn_dim,
            "experts_per_rank": args.experts_per_rank,
            "tokens_per_rank": args.tokens,
            "dtype": "float32",
            "warmup_rounds": args.warmup,
            "timed_rounds": args.repeats,
            "torch": torch.__version__,
        },
        "step_s": wall["step"],
        "ratios": wall["ratios"],
        "cpu_s": cpu["step"],
        "cpu_ratios": cpu["ratios"],
        "wire_bytes": {
            "per_rank": wire,
            "ours_equal_routed_rows_on_every_rank": all(
                w[name]["bytes_equal_routed_rows"] for w in wire for name in ("ours_top2", "ours_top_any")
            ),
        },
        "routing": {
            "mean_k_top2": per_rank[0]["mean_k_top2"],
            "mean_k_top_any": per_rank[0]["mean_k_top_any"],
            "top_any_threshold": per_rank[0]["top_any_threshold"],
            "received_rows_per_expert": [r["received_rows_per_expert"] for r in per_rank],
        },
        "per_rank_step_s": per_rank_table(per_rank, "times"),
        "per_rank_cpu_s": per_rank_table(per_rank, "cpu"),
    }


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.bench ep", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=1024)
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pin", action="store_true", help="pin rank r to core r (mod the cores available)")
    p.add_argument("--timeout", type=float, default=1200.0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    shapes = parts.Shapes(args.dim, args.ffn_dim, args.experts_per_rank, args.tokens)
    per_rank = run_simulated(
        rank_worker,
        args.ranks,
        args=(asdict(shapes), args.warmup, args.repeats, args.pin),
        timeout_s=args.timeout,
        collective_timeout_s=args.timeout,
    )
    print(json.dumps(summarise(per_rank, args), indent=2))
