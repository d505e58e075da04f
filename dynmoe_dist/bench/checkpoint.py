"""`python -m dynmoe_dist.bench checkpoint [--ranks 1,2,4] [--tiny] [--out FILE]`: host memory and time of
saving and loading the dense checkpoint state (train/dense_state.py) under FSDP.

A SmolLM2-shaped model (transformers ``LlamaConfig``: 30 blocks, hidden 576, FFN 1536, 9 heads with 3
key-value heads, vocabulary 49152, tied head; random weights, nothing downloaded) has its last two MLPs
upcycled into 4 gated DynMoE experts each, as launcher/configs/smollm2_dynmoe.toml does, and every
parameter trains. On N gloo ranks (N = 1 is one process, nothing to shard) the dense weights are sharded
with FSDP2 and experts are expert-parallel; one training step creates the Adam state. Then every rank
  saves   the dense state (weights, exp_avg, exp_avg_sq, step) into one DCP directory, and
  loads   it back into its zeroed weights with the optimizer state dropped first (what a resuming run
          holds: weights, no Adam state), checking afterwards that every weight came back (a per-tensor checksum).
For each, every rank reports its peak resident memory above its resident memory just before (Linux
VmHWM after resetting it, in a fresh process with a fixed mmap threshold: bench/measure.py) and the
wall time; a phase's time is the slowest rank's. Target: peak extra memory per rank <= 1.2/N of the
full dense state (what one process would hold) plus a constant for DCP's planning and I/O buffers.
Experts are not part of this measurement: they are written by their owners as before.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Dict, List

import torch

from ..config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from ..moe import MoEConfig
from .measure import emit_json, machine_info, measured_call, memory_process_env, next_token_step

MIB = 2**20
TARGET_SHARE, TARGET_CONSTANT_MIB = 1.2, 64.0
SMOLLM2 = dict(vocab=49152, dim=576, ffn=1536, layers=30, heads=9, kv_heads=3)
TINY = dict(vocab=512, dim=64, ffn=128, layers=3, heads=4, kv_heads=2)
MEMORY_METHOD = (
    "every rank is a fresh spawned process with MALLOC_MMAP_THRESHOLD_=131072 (each tensor above 128 KiB is "
    "its own mapping, so freed memory leaves the resident set); a warm-up save and load of one tensor pays "
    "DCP's one-time costs; before each phase: gc, malloc_trim, VmRSS as the baseline, the high-water mark "
    "reset (5 > /proc/self/clear_refs); after it: VmHWM - baseline in MiB"
)


def run_config(shape: Dict, num_experts: int) -> RunConfig:
    """The benchmark's settings: the last two blocks upcycled, every parameter trained, dense FSDP."""
    layers = shape["layers"]
    return RunConfig(
        model=ModelConfig(
            source="hf",
            path="(a SmolLM2-shaped LlamaForCausalLM with random weights, in memory)",
            num_layers=layers,
            moe_layers=[layers - 2, layers - 1],
        ),
        moe=MoEConfig(num_experts=num_experts, max_experts=2 * num_experts),
        train=TrainConfig(lr=1e-4, weight_decay=0.01),
        parallel=ParallelConfig(dense_sharding="fsdp"),
    )


def build_model(shape: Dict, config: RunConfig) -> torch.nn.Module:
    """The SmolLM2-shaped Llama (random weights) with its last two MLPs upcycled, as the trainer sees it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..models.build import hf_causal_lm_from
    from ..tasks.base import ModelNeeds

    hf_config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["dim"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    needs = ModelNeeds("causal-lm", shape["vocab"])
    return hf_causal_lm_from(LlamaForCausalLM(hf_config), config.model, config.moe, needs)


def _local_sums(params) -> List[float]:
    from ..parallel.fsdp import local

    return [float(local(p.detach()).double().sum()) for _, p in params]


def _warm_up(directory: Path, params, optimizer, groups) -> None:
    """One save and load of a single tensor: imports, thread pools and first calls are not the figure."""
    from ..train.dense_state import load_dense, save_dense

    save_dense(directory, params, optimizer, groups)
    load_dense(directory, params, optimizer, groups)


def rank_case(spec: Dict) -> Dict:
    """One rank: build, shard, one step, then save and load the dense state, measured."""
    from ..models.source import BuiltModel
    from ..parallel.fsdp import local
    from ..parallel.groups import barrier
    from ..parallel.reshard import dense_named_parameters
    from ..train.dense_state import dense_state_dict, load_dense, save_dense
    from ..train.parts import build_parts

    torch.set_num_threads(1)
    config = run_config(spec["shape"], num_experts=4)
    model = build_model(spec["shape"], config)
    with warnings.catch_warnings():  # one rank: FSDP has nothing to shard, and says so
        warnings.simplefilter("ignore", UserWarning)
        parts = build_parts(config, BuiltModel(model))
    groups, shards, optimizer = parts.groups, parts.experts.shards, parts.optimizer
    tokens = torch.randint(0, spec["shape"]["vocab"], (1, 17), generator=torch.Generator().manual_seed(1))
    next_token_step(parts, tokens)()  # the trainer's step: the Adam state exists from here on

    params = dense_named_parameters(model, shards)
    state = dense_state_dict(params, optimizer)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())  # a DTensor's numel is the global one
    local_bytes = sum(local(t).numel() * t.element_size() for t in state.values())
    del state
    directory = Path(spec["directory"])
    _warm_up(directory.with_name("warm_up"), params[:1], optimizer, groups)
    barrier(groups, "bench checkpoint save")
    save_peak, save_s = measured_call(lambda: save_dense(directory, params, optimizer, groups))
    before = _local_sums(params)
    optimizer.state.clear()  # a resuming run holds weights and no Adam state yet
    with torch.no_grad():
        for _, p in params:
            local(p.detach()).zero_()
    barrier(groups, "bench checkpoint load")
    load_peak, load_s = measured_call(lambda: load_dense(directory, params, optimizer, groups))
    own_file = directory / f"__{groups.rank}_0.distcp"
    return {
        "rank": groups.rank,
        "full_dense_state_bytes": full_bytes,
        "local_dense_state_bytes": local_bytes,
        "file_bytes": own_file.stat().st_size if own_file.is_file() else 0,
        "save_peak_extra_mib": save_peak,
        "load_peak_extra_mib": load_peak,
        "save_s": save_s,
        "load_s": load_s,
        "weights_restored": _local_sums(params) == before,
    }


def run_case(world: int, shape: Dict, timeout_s: float) -> Dict:
    from ..parallel.simulate import run_simulated

    directory = Path(tempfile.mkdtemp(prefix=f"bench_checkpoint_{world}_")) / "dense"
    try:
        per_rank = run_simulated(
            rank_case, world, args=({"shape": shape, "directory": str(directory)},), timeout_s=timeout_s
        )
    finally:
        shutil.rmtree(directory.parent, ignore_errors=True)
    return summarize(world, per_rank)


def summarize(world: int, per_rank: List[Dict]) -> Dict:
    full_mib = per_rank[0]["full_dense_state_bytes"] / MIB
    target = TARGET_SHARE / world * full_mib + TARGET_CONSTANT_MIB
    worst = {k: max(r[k] for r in per_rank) for k in ("save_peak_extra_mib", "load_peak_extra_mib")}
    return {
        "ranks": world,
        "full_dense_state_mib": round(full_mib, 2),
        "target_peak_extra_mib": round(target, 2),
        "save_s": round(max(r["save_s"] for r in per_rank), 3),
        "load_s": round(max(r["load_s"] for r in per_rank), 3),
        "max_save_peak_extra_mib": worst["save_peak_extra_mib"],
        "max_load_peak_extra_mib": worst["load_peak_extra_mib"],
        "meets_target": all(v <= target for v in worst.values()),
        "weights_restored": all(r["weights_restored"] for r in per_rank),
        "per_rank": [
            {
                **{k: r[k] for k in ("rank", "save_peak_extra_mib", "load_peak_extra_mib")},
                "save_s": round(r["save_s"], 3),
                "load_s": round(r["load_s"], 3),
                "local_dense_state_mib": round(r["local_dense_state_bytes"] / MIB, 2),
                "file_mib": round(r["file_bytes"] / MIB, 2),
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
        raise SystemExit(f"--ranks ({text!r}) must be a comma-separated list of positive integers, e.g. 1,2,4")
    return ranks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", default="1,2,4", help="world sizes to measure, comma-separated (default 1,2,4)")
    p.add_argument("--tiny", action="store_true", help="a small model (3 blocks, hidden 64): a smoke run")
    p.add_argument("--num-layers", type=int, help="blocks (default: SmolLM2's 30; the last two are MoE)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--timeout-s", type=float, default=900)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    ranks = parse_ranks(args.ranks)
    shape = dict(TINY if args.tiny else SMOLLM2)
    if args.num_layers is not None:
        if args.num_layers < 2:
            raise SystemExit(f"--num-layers ({args.num_layers}) must be >= 2: the last two blocks are MoE")
        shape["layers"] = args.num_layers
    with memory_process_env():  # the spawned ranks inherit it
        cases = [run_case(world, shape, args.timeout_s) for world in ranks]
    result = {
        "benchmark": "checkpoint",
        "model": {**shape, "moe_layers": [shape["layers"] - 2, shape["layers"] - 1], "num_experts": 4},
        "target": f"peak extra host memory per rank <= {TARGET_SHARE}/N x full dense state + {TARGET_CONSTANT_MIB} MiB",
        "cases": cases,
        "memory_method": MEMORY_METHOD,
        "machine": machine_info(1),
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
