"""`python -m dynmoe_dist.bench checkpoint [--ranks 1,2,3] [--tiny] [--out FILE]`: what the end of a run adds to
a rank's peak host memory (the held-out evaluation, and the checkpoint write with the experts and their Adam
state), and the dense state's load.

An imported Qwen3-MoE written by bench/moe_checkpoint.py (4 layers of 16 experts, top-2, hidden 256,
moe_intermediate_size 768, vocabulary 4096; float32, random weights: the experts are about 90 % of the
parameters, as in the MoEs people finetune) is loaded as a run loads it (model.path, native routing) on N
gloo ranks (N = 1 is one process): experts expert-parallel over all N, dense weights FSDP-sharded. One
training step (train/step.py) creates the Adam state. Then every rank, one phase after the other:
  evaluate  train/step.py's evaluate_totals over --eval-batches held-out batches (what Trainer.evaluate runs);
  save      the checkpoint's weight parts written as the trainer writes them (CheckpointManager with
            train/checkpoint_parts.py's weight_parts): the experts it owns with their Adam state streamed
            into experts_ep{r}.safetensors, its dense shard with its Adam state into dense/ (DCP);
  load      the dense state back into its zeroed dense weights with the optimizer state dropped first (what
            a resuming run holds), checked afterwards by a per-tensor checksum.
Each phase's figure is the rank's peak resident memory above its resident memory just before (Linux VmHWM
after resetting it, in a fresh process with a fixed mmap threshold: bench/measure.py) and its wall time; a
phase's time is the slowest rank's. A rank's share is the bytes of the parameters it holds (its experts, its
shard of the dense weights): what loading the model costs it. Targets: evaluating and saving each add at most
0.1 x the share + 64 MiB to a rank's peak (neither holds a copy of the weights, of the experts or of their
Adam state); loading the dense state at most 1.2/N x the full dense state + 64 MiB.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Dict, List

import torch

from ..config import RunConfig, from_dict, model_source_defaults, resolve_num_layers
from .hf_moe import MODERATE, TINY
from .measure import (
    emit_json,
    machine_info,
    measured_call,
    memory_process_env,
    next_token_step,
    tensors_mib,
)
from .moe_checkpoint import write_checkpoint

MIB = 2**20
TARGETS = {"end_extra_share": 0.1, "end_extra_mib": 64.0, "load_share": 1.2, "load_mib": 64.0}
PHASES = ("evaluate", "save", "load")
MEMORY_METHOD = (
    "every rank is a fresh spawned process with MALLOC_MMAP_THRESHOLD_=131072 (each tensor above 128 KiB is "
    "its own mapping, so freed memory leaves the resident set); a warm-up evaluation and a warm-up save and "
    "load of one dense tensor pay the one-time costs; before each phase: gc, malloc_trim, VmRSS as the "
    "baseline, the high-water mark reset (5 > /proc/self/clear_refs); after it: VmHWM - baseline in MiB"
)


def run_config(model_dir: str, out_dir: str) -> RunConfig:
    """The imported run: routing, expert count and MoE blocks from config.json (as load_config fills them),
    experts over the whole world, dense weights FSDP-sharded, checkpoints under out_dir."""
    data: Dict = {
        "model": {"source": "hf", "path": model_dir},
        "train": {"lr": 1e-4, "weight_decay": 0.01},
        "parallel": {"dense_sharding": "fsdp"},
        "output": {"out_dir": out_dir},
    }
    model_source_defaults(data)
    config = from_dict(data)
    resolve_num_layers(config.model)
    return config


def _dense_sums(params) -> List[float]:
    from ..parallel.fsdp import local

    return [float(local(p.detach()).double().sum()) for _, p in params]


def _warm_up(directory: Path, parts, evaluate) -> None:
    """An evaluation and one dense tensor saved and loaded: imports, thread pools and first calls are not
    the figures."""
    from ..moe.layer import dense_state_tensors
    from ..train.dense_state import load_dense, save_dense

    evaluate()
    params = dense_state_tensors(parts.model)[:1]
    save_dense(directory, params, parts.optimizer, parts.groups)
    load_dense(directory, params, parts.optimizer, parts.groups)


def rank_case(spec: Dict) -> Dict:
    """One rank: load the imported MoE, one step, then evaluate, save and load, each measured."""
    from ..models.build import build_model
    from ..moe.layer import dense_state_tensors
    from ..parallel.fsdp import local
    from ..parallel.groups import barrier
    from ..tasks.base import Batch, ModelNeeds
    from ..tasks.causal_lm import next_token_terms
    from ..train.checkpoint import CheckpointManager
    from ..train.checkpoint_parts import weight_parts
    from ..train.dense_state import dense_state_dict
    from ..train.parts import build_parts
    from ..train.step import evaluate_totals

    torch.set_num_threads(1)
    config = run_config(spec["model_dir"], spec["out_dir"])
    with warnings.catch_warnings():  # one rank: FSDP has nothing to shard, and says so
        warnings.simplefilter("ignore", UserWarning)
        parts = build_parts(config, build_model(config.model, config.moe, ModelNeeds("causal-lm", spec["vocab"])))
    groups, model = parts.groups, parts.model
    shape = (spec["batch"], spec["seq_len"] + 1)
    tokens = torch.randint(0, spec["vocab"], shape, generator=torch.Generator().manual_seed(1 + groups.rank))
    next_token_step(parts, tokens)()  # the trainer's step: the Adam state exists from here on
    batches = [Batch({"input_ids": tokens[:, :-1]}, tokens[:, 1:])] * spec["eval_batches"]
    losses: List[torch.Tensor] = []

    def evaluate() -> None:
        losses.append(evaluate_totals(parts, batches, next_token_terms))

    dense = dense_state_tensors(model)
    state = dense_state_dict(dense, parts.optimizer)  # weights and Adam state, as DCP saves them
    full_dense = sum(t.numel() * t.element_size() for t in state.values())  # a DTensor's numel is the whole one
    del state
    _warm_up(Path(spec["out_dir"]) / "warm_up", parts, evaluate)
    barrier(groups, "bench checkpoint evaluate")
    evaluate_peak, evaluate_s = measured_call(evaluate)
    manager = CheckpointManager(config, groups, weight_parts(parts))
    barrier(groups, "bench checkpoint save")
    paths: List[Path] = []
    save_peak, save_s = measured_call(lambda: paths.append(manager.save(1)))
    before = _dense_sums(dense)
    parts.optimizer.state.clear()  # a resuming run holds weights and no Adam state yet
    with torch.no_grad():
        for _, t in dense:
            local(t.detach()).zero_()
    barrier(groups, "bench checkpoint load")
    load_peak, load_s = measured_call(lambda: weight_parts(parts)["dense"].load_files(paths[0], {}))
    return {
        "rank": groups.rank,
        "share_mib": tensors_mib(model.parameters()),
        "experts_mib": tensors_mib(p for shard in parts.experts.shards for p in shard.layer.experts.parameters()),
        "full_dense_state_mib": full_dense / MIB,
        "expert_file_mib": sum(f.stat().st_size for f in paths[0].glob(f"experts_ep{groups.ep_rank}.*")) / MIB,
        "peak_extra_mib": {"evaluate": evaluate_peak, "save": save_peak, "load": load_peak},
        "seconds": {"evaluate": evaluate_s, "save": save_s, "load": load_s},
        "weights_restored": _dense_sums(dense) == before,
        "evaluation_loss_sum": float(losses[-1][0]),
    }


def run_case(world: int, spec: Dict, timeout_s: float) -> Dict:
    from ..parallel.simulate import run_simulated

    out_dir = Path(tempfile.mkdtemp(prefix=f"bench_checkpoint_{world}_"))
    try:
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        per_rank = run_simulated(
            rank_case, world, args=({**spec, "out_dir": str(out_dir)},), timeout_s=timeout_s, env=env
        )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return summarize(world, per_rank)


def targets_mib(world: int, rank: Dict) -> Dict[str, float]:
    """A rank's targets: evaluate and save against its share, load against the full dense state / N."""
    end = TARGETS["end_extra_share"] * rank["share_mib"] + TARGETS["end_extra_mib"]
    load = TARGETS["load_share"] / world * rank["full_dense_state_mib"] + TARGETS["load_mib"]
    return {"evaluate": end, "save": end, "load": load}


def summarize(world: int, per_rank: List[Dict]) -> Dict:
    """Per phase: the worst rank's extra peak, its ratio to that rank's share, and whether every rank meets
    its target; the slowest rank's time."""
    phases = {}
    for phase in PHASES:
        peaks = [r["peak_extra_mib"][phase] for r in per_rank]
        phases[phase] = {
            "max_peak_extra_mib": round(max(peaks), 2),
            "max_peak_extra_over_share": round(max(p / r["share_mib"] for p, r in zip(peaks, per_rank)), 4),
            "meets_target": all(r["peak_extra_mib"][phase] <= targets_mib(world, r)[phase] for r in per_rank),
            "seconds": round(max(r["seconds"][phase] for r in per_rank), 3),
        }
    return {
        "ranks": world,
        "max_share_mib": round(max(r["share_mib"] for r in per_rank), 2),
        "full_dense_state_mib": round(per_rank[0]["full_dense_state_mib"], 2),
        "phases": phases,
        "meets_targets": all(p["meets_target"] for p in phases.values()),
        "weights_restored": all(r["weights_restored"] for r in per_rank),
        "per_rank": [
            {
                "rank": r["rank"],
                "share_mib": round(r["share_mib"], 2),
                "experts_mib": round(r["experts_mib"], 2),
                "expert_file_mib": round(r["expert_file_mib"], 2),
                # weights, exp_avg and exp_avg_sq of every expert it owns (each owned once): about 3
                "expert_file_over_experts": round(r["expert_file_mib"] / r["experts_mib"], 3),
                "peak_extra_mib": {k: round(v, 2) for k, v in r["peak_extra_mib"].items()},
                "target_mib": {k: round(v, 2) for k, v in targets_mib(world, r).items()},
            }
            for r in per_rank
        ],
    }


def parse_ranks(text: str) -> List[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise SystemExit(f"--ranks ({text!r}) must be a comma-separated list of positive integers, e.g. 1,2,3")
    return ranks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", default="1,2,3", help="world sizes to measure, comma-separated (default 1,2,3)")
    p.add_argument("--tiny", action="store_true", help="a tiny MoE (2 layers of 4 experts, hidden 32): a smoke run")
    p.add_argument("--eval-batches", type=int, default=2, help="held-out batches of the evaluation (default 2)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--timeout-s", type=float, default=900)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    ranks = parse_ranks(args.ranks)
    shape = TINY if args.tiny else MODERATE
    if max(ranks) > shape.num_experts:
        raise SystemExit(f"--ranks ({args.ranks!r}) must be at most {shape.num_experts}: one expert per rank at least")
    if args.eval_batches < 1:
        raise SystemExit(f"--eval-batches ({args.eval_batches}) must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_model_"))
    try:
        model_dir = root / "imported_moe"
        described = write_checkpoint(model_dir, shape, max_shard_bytes=256 * MIB)
        spec = dict(model_dir=str(model_dir), vocab=shape.vocab, batch=2, seq_len=32 if args.tiny else 128)
        spec["eval_batches"] = args.eval_batches
        with memory_process_env():  # the spawned ranks inherit it
            cases = [run_case(world, spec, args.timeout_s) for world in ranks]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "checkpoint",
        "model": described,
        "target": (
            f"evaluate and save: peak extra host memory per rank <= {TARGETS['end_extra_share']} x its share + "
            f"{TARGETS['end_extra_mib']} MiB; load (dense): <= {TARGETS['load_share']}/N x full dense state + "
            f"{TARGETS['load_mib']} MiB"
        ),
        "cases": cases,
        "memory_method": MEMORY_METHOD,
        "machine": machine_info(1),
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
