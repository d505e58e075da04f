"""`python -m dynmoe_dist.bench memory`: memory per rank and step time, dense weights replicated vs FSDP.

A SmolLM2-shaped causal LM (D = 576, F = 1536, 9 heads, vocabulary 49152 with a tied head; 6 blocks by
default, 2 of them MoE with 4 experts each; random weights) trains on random tokens on a simulated gloo
cluster of 2 and 4 ranks, once with ``parallel.dense_sharding = "replicate"`` and once with ``"fsdp"``
(experts stay expert-parallel either way). Every rank reports, in MiB:
  parameters / gradients / optimizer_state  bytes this rank holds (a shard's local part under FSDP),
                                            dense and expert separately;
  step_peak_rss                             peak resident memory of one step above the resident memory
                                            before it (activations, gathered FSDP weights, buffers);
and the median step time. A step's time is the slowest rank's. The dense weights dominate this model, so
dense parameter + optimizer memory per rank is what FSDP must cut: target <= 1.1/N of the replicated
figure, at a step-time overhead of at most 1.25x on gloo.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch

from ..config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from ..models.build import build_model
from ..moe import MoEConfig
from ..parallel.groups import barrier, current_world_size
from ..parallel.simulate import run_simulated
from ..tasks.base import ModelNeeds
from ..train.parts import build_parts
from .measure import (
    GradientsAtStep,
    machine_info,
    memory_supported,
    next_token_step,
    optimizer_state,
    peak_rss_above_baseline_mb,
    tensors_mib,
)

TARGETS = {"dense_state_per_rank_x_world": 1.1, "fsdp_step_time_ratio": 1.25}
VOCAB = 49152


def run_config(spec: Dict, world_size: int) -> RunConfig:
    """The benchmark's model and parallel settings as a run config (what build_model and build_parts read)."""
    num_layers = spec["num_layers"]
    return RunConfig(
        model=ModelConfig(
            dim=576, num_heads=9, num_layers=num_layers, ffn_dim=1536, moe_layers=[num_layers - 2, num_layers - 1]
        ),
        moe=MoEConfig(num_experts=2 * world_size, aux_loss_weight=0.01),
        train=TrainConfig(lr=1e-4, weight_decay=0.01),
        parallel=ParallelConfig(dense_sharding=spec["dense"], fsdp_reshard_after_forward=spec["reshard_after_forward"]),
    )


def rank_case(spec: Dict) -> Dict:
    """One rank: build, shard, train `steps` steps (the trainer's step), report its memory and step times."""
    from ..parallel.reshard import dense_named_parameters

    torch.set_num_threads(1)
    config = run_config(spec, current_world_size())
    torch.manual_seed(0)
    parts = build_parts(
        config, build_model(config.model, config.moe, ModelNeeds("causal-lm", VOCAB, max_len=spec["seq_len"]))
    )
    model = parts.model
    tokens = torch.randint(
        0, VOCAB, (spec["batch_per_rank"], spec["seq_len"]), generator=torch.Generator().manual_seed(1)
    )
    dense = [p for _, p in dense_named_parameters(model, parts.experts.shards)]
    experts = [p for shard in parts.experts.shards for p in shard.layer.experts.parameters()]
    gradients = GradientsAtStep(parts.optimizer, {"dense": dense, "experts": experts})
    step = next_token_step(parts, tokens, input_name="tokens_BL")  # the built-in CausalLM's forward
    step()  # optimizer state exists from here on
    peak = peak_rss_above_baseline_mb(step) if memory_supported() else None
    times = []
    for _ in range(spec["steps"]):
        barrier(parts.groups, "bench memory step")
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {
        "rank": parts.groups.rank,
        "dense_parameters_mib": tensors_mib(dense),
        "expert_parameters_mib": tensors_mib(experts),
        "dense_gradients_mib": gradients.mib["dense"],
        "expert_gradients_mib": gradients.mib["experts"],
        "dense_optimizer_state_mib": tensors_mib(optimizer_state(parts.optimizer, dense)),
        "expert_optimizer_state_mib": tensors_mib(optimizer_state(parts.optimizer, experts)),
        "step_peak_rss_mib": peak,
        "step_s": times,
    }


def run_case(world: int, dense: str, args) -> Dict:
    spec = {
        "dense": dense,
        "num_layers": args.num_layers,
        "seq_len": args.seq_len,
        "batch_per_rank": args.batch_per_rank,
        "steps": args.steps,
        "reshard_after_forward": args.reshard_after_forward,
    }
    per_rank = run_simulated(rank_case, world, args=(spec,), timeout_s=args.timeout_s)
    slowest = [max(steps) for steps in zip(*(r["step_s"] for r in per_rank))]
    keys = [k for k in per_rank[0] if k.endswith("_mib")]
    worst = {k: max(r[k] for r in per_rank) if per_rank[0][k] is not None else None for k in keys}
    dense_state = max(r["dense_parameters_mib"] + r["dense_optimizer_state_mib"] for r in per_rank)
    return {
        "world": world,
        "dense_sharding": dense,
        "step_s_median": statistics.median(slowest),
        "per_rank_max": {k: round(v, 2) if v is not None else None for k, v in worst.items()},
        "dense_state_mib": round(dense_state, 2),
    }


def compare(cases: List[Dict]) -> List[Dict]:
    """fsdp against replicate at each world size, with the targets."""
    out = []
    for world in sorted({c["world"] for c in cases}):
        rep = next(c for c in cases if c["world"] == world and c["dense_sharding"] == "replicate")
        fsdp = next(c for c in cases if c["world"] == world and c["dense_sharding"] == "fsdp")
        state_ratio = fsdp["dense_state_mib"] / rep["dense_state_mib"]
        time_ratio = fsdp["step_s_median"] / rep["step_s_median"]
        out.append(
            {
                "world": world,
                "dense_state_fsdp_over_replicate": round(state_ratio, 4),
                "dense_state_x_world": round(state_ratio * world, 3),
                "meets_state_target": state_ratio * world <= TARGETS["dense_state_per_rank_x_world"],
                "step_time_fsdp_over_replicate": round(time_ratio, 3),
                "meets_time_target": time_ratio <= TARGETS["fsdp_step_time_ratio"],
            }
        )
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--num-layers", type=int, default=6, help="blocks (SmolLM2 has 30; the last two are MoE)")
    p.add_argument("--seq-len", type=int, default=65)
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="keep gathered block weights from forward to backward (parallel.fsdp_reshard_after_forward)",
    )
    p.add_argument("--timeout-s", type=float, default=900)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.num_layers < 2:
        raise SystemExit(f"--num-layers ({args.num_layers}) must be >= 2: the last two blocks are MoE")
    cases = [run_case(world, dense, args) for world in args.worlds for dense in ("replicate", "fsdp")]
    print(
        json.dumps(
            {
                "benchmark": "memory",
                "targets": TARGETS,
                "cases": cases,
                "comparison": compare(cases),
                "config": vars(args),
                "machine": machine_info(1),
            },
            indent=1,
        )
    )
