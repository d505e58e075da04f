"""`python -m dynmoe_dist.bench hf`: training step time and memory per rank of an upcycled SmolLM2-shaped
LLaMA against the dense model, at the same tokens and equal active parameters.

The model is a ``transformers.LlamaForCausalLM`` with SmolLM2-135M's shapes (D = 576, F = 1536, 9 heads,
3 key/value heads, vocabulary 49152, tied embedding) and random weights; 4 blocks by default instead of
30. The MoE model upcycles every block's MLP (``--moe-blocks``) into ``--num-experts`` gated experts of
the dense MLP's size with a top-k router, k = 1: each token runs one expert, i.e. exactly the dense
FFN's parameters (the router adds E x D per block). Both train on the same random tokens on 2 simulated
gloo ranks: the dense model data-parallel, the MoE model with its experts expert-parallel over both ranks
(one all-to-all each way per MoE block) and its dense weights data-parallel. The tied embedding is frozen
by default, as in the SmolLM2 demo (launcher/configs/smollm2_dynmoe.toml): its 28M-parameter AdamW update
and gradient all-reduce would otherwise be most of both steps and hide the MoE's cost (``--train-embedding``
includes it).

Both models live in the same rank processes and their steps alternate (dense, MoE, dense, ...), so load
from other processes hits both alike; a step's time is the slowest rank's, the figure the median over
steps. Memory per rank, in MiB: ``state`` = parameters + gradients + AdamW state this rank holds, and
``step_peak_rss`` = peak resident memory of one step above the resident memory before it (activations,
all-to-all buffers). Target: MoE step <= 1.3 x the dense step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Dict, List, TypedDict

import torch
import torch.nn as nn

from ..config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from ..moe import MoEConfig
from ..moe.layer import find_moe_layers
from ..parallel.groups import barrier, current_rank
from ..parallel.simulate import run_simulated
from .measure import (
    GradientsAtStep,
    machine_info,
    memory_supported,
    next_token_step,
    peak_rss_above_baseline_mb,
    state_mib,
)

TARGETS = {"moe_over_dense_step_time": 1.3}


class LlamaShape(TypedDict):
    """The LlamaConfig fields the benchmark sets (besides num_hidden_layers)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int


SMOLLM2 = LlamaShape(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


def dense_llama(num_layers: int, **shape) -> nn.Module:
    """SmolLM2's shapes (``shape`` overrides some, for toy runs) with random weights, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=num_layers, **{**SMOLLM2, **shape})).train()


def run_config(args: argparse.Namespace, blocks: List[int], ep_size: int) -> RunConfig:
    """One case's settings: the in-memory LLaMA (model.moe_layers upcycled into top-1 experts), the tied
    embedding frozen unless --train-embedding, experts over ep_size ranks."""
    return RunConfig(
        model=ModelConfig(
            source="hf",
            path="(a SmolLM2-shaped LlamaForCausalLM with random weights, in memory)",
            num_layers=args.num_layers,
            moe_layers=blocks,
            freeze=[] if args.train_embedding else ["model.embed_tokens"],
        ),
        moe=MoEConfig(num_experts=args.num_experts, router="top_k", top_k=1, aux_loss_weight=0.01),
        train=TrainConfig(lr=1e-4, weight_decay=0.01),
        parallel=ParallelConfig(ep_size=ep_size),
    )


def active_parameters(model: nn.Module) -> int:
    """Parameters one token uses: all of them, but only top_k experts' worth of each MoE layer."""
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    for _, layer in find_moe_layers(model):
        expert_params = [sum(p.numel() for p in e.parameters()) for e in layer.experts.experts]
        total -= sum(expert_params) - layer.config.top_k * max(expert_params)
    return total


class Case:
    """One model on this rank, assembled by build_parts; ``step()`` trains once, as the trainer does."""

    def __init__(self, hf_model: nn.Module, config: RunConfig, tokens_BL: torch.Tensor, vocab: int = 0):
        from ..models.build import hf_causal_lm_from
        from ..models.source import BuiltModel
        from ..tasks.base import ModelNeeds
        from ..train.parts import build_parts

        torch.manual_seed(1)  # the routers' initialisation
        needs = ModelNeeds("causal-lm", vocab or SMOLLM2["vocab_size"], max_len=tokens_BL.shape[1])
        model = hf_causal_lm_from(hf_model, config.model, config.moe, needs)
        self.active_parameters = active_parameters(model)  # before expert parallelism keeps this rank's experts
        self.parts = build_parts(config, BuiltModel(model))
        self.gradients = GradientsAtStep(self.parts.optimizer, {"all": list(self.parts.model.parameters())})
        self.step = next_token_step(self.parts, tokens_BL)  # the trainer's step (train/step.py)

    def state_mib(self) -> float:
        return state_mib(self.parts.model, self.parts.optimizer, self.gradients)


def rank_case(spec: Dict) -> Dict:
    """One rank: build both models, alternate their steps, report times and memory."""
    torch.set_num_threads(1)
    args = argparse.Namespace(**spec)  # the command line's options, rebuilt in the rank process
    blocks = list(range(args.num_layers)) if args.moe_blocks is None else args.moe_blocks
    dense = dense_llama(args.num_layers)
    rank = current_rank()
    tokens = torch.randint(
        0,
        SMOLLM2["vocab_size"],
        (args.batch_per_rank, args.seq_len + 1),
        generator=torch.Generator().manual_seed(100 + rank),
    )
    cases = {
        "dense": Case(copy.deepcopy(dense), run_config(args, [], ep_size=1), tokens),
        "moe": Case(dense, run_config(args, blocks, ep_size=2), tokens),
    }
    active = {name: case.active_parameters for name, case in cases.items()}
    peaks = {}
    for name, case in cases.items():
        case.step()  # warm-up; optimizer state exists from here on
        peaks[name] = peak_rss_above_baseline_mb(case.step) if memory_supported() else None
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for _ in range(args.steps):
        for name, case in cases.items():
            barrier(case.parts.groups, "bench hf step")
            started = time.perf_counter()
            case.step()
            times[name].append(time.perf_counter() - started)
    return {
        "rank": rank,
        "active_parameters": active,
        "step_s": times,
        "step_peak_rss_mib": peaks,
        "state_mib": {name: case.state_mib() for name, case in cases.items()},
    }


# -- the GPU check's section (bench/gpu_sections.py) ------------------------------------------------------
GPU_CASE = dict(num_layers=4, num_experts=4, seq_len=512, batch=8, steps=5)
REHEARSAL_CASE = dict(num_layers=1, num_experts=2, seq_len=16, batch=1, steps=1)
REHEARSAL_SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=256
)


def gpu_step_tokens_per_s(context: dict) -> Dict:
    """One process on context['device'] (CUDA; the CPU in the check's rehearsal, at toy sizes): the
    upcycled SmolLM2-shaped LLaMA (every block's MLP into top-1 experts, assembled by build_parts like a
    run), bf16 autocast training steps with AdamW; the median step's tokens/s."""
    rehearsal = bool(context.get("rehearsal"))
    case, shape = (REHEARSAL_CASE, REHEARSAL_SHAPE) if rehearsal else (GPU_CASE, {})
    vocab = int(shape.get("vocab_size", SMOLLM2["vocab_size"]))
    args = argparse.Namespace(num_layers=case["num_layers"], num_experts=case["num_experts"], train_embedding=False)
    config = run_config(args, list(range(case["num_layers"])), ep_size=1)
    config.parallel.device = "cuda" if context["device"] == "cuda" else "cpu"
    tokens_BL = torch.randint(
        0, vocab, (case["batch"], case["seq_len"] + 1), generator=torch.Generator().manual_seed(0)
    )
    step = Case(dense_llama(case["num_layers"], **shape), config, tokens_BL.to(config.parallel.device), vocab).step
    with torch.autocast(context["device"], dtype=torch.bfloat16):
        step()  # warm-up: kernels, allocator, optimizer state
        seconds = [_timed(step, context["device"]) for _ in range(case["steps"])]
    tokens_per_s = case["batch"] * case["seq_len"] / statistics.median(seconds)
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "step_s": [round(t, 4) for t in seconds],
        "case": case,
        "summary": f"{tokens_per_s:.0f} tokens/s (median of {len(seconds)} steps)",
    }


def _timed(step, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()  # NOTE: device-to-host sync: the step's end, for the timer
    return time.perf_counter() - started


def summarize(per_rank: List[Dict]) -> Dict:
    """Slowest rank per step, median over steps; memory: the largest rank's; the ratio and the target."""
    out: Dict = {"cases": {}}
    for name in ("dense", "moe"):
        slowest = [max(steps) for steps in zip(*(r["step_s"][name] for r in per_rank))]
        peaks = [r["step_peak_rss_mib"][name] for r in per_rank]
        out["cases"][name] = {
            "step_s_median": round(statistics.median(slowest), 4),
            "step_s_min": round(min(slowest), 4),
            "state_mib_per_rank": max(r["state_mib"][name] for r in per_rank),
            "step_peak_rss_mib_per_rank": None if None in peaks else max(peaks),
            "active_parameters": per_rank[0]["active_parameters"][name],
        }
    ratio = out["cases"]["moe"]["step_s_median"] / out["cases"]["dense"]["step_s_median"]
    active = out["cases"]["moe"]["active_parameters"] / out["cases"]["dense"]["active_parameters"]
    out["moe_over_dense_step_time"] = round(ratio, 3)
    out["moe_over_dense_active_parameters"] = round(active, 5)
    out["meets_time_target"] = ratio <= TARGETS["moe_over_dense_step_time"]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-layers", type=int, default=4, help="LLaMA blocks (SmolLM2-135M has 30)")
    p.add_argument("--moe-blocks", type=int, nargs="+", default=None, help="upcycled blocks (default: all)")
    p.add_argument("--num-experts", type=int, default=4, help="experts per MoE block (2 per rank)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per model (after 2 untimed ones)")
    p.add_argument("--train-embedding", action="store_true", help="train the tied embedding too")
    p.add_argument("--timeout-s", type=float, default=900)
    return p


def check(args) -> None:
    if args.num_layers < 1:
        raise ValueError(f"--num-layers ({args.num_layers}) must be >= 1")
    if args.num_experts < 2:
        raise ValueError(f"--num-experts ({args.num_experts}) must be >= 2: one expert per rank at least")
    for block in args.moe_blocks or []:
        if not 0 <= block < args.num_layers:
            raise ValueError(f"--moe-blocks ({args.moe_blocks}) must lie in 0..{args.num_layers - 1}")


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        check(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    spec = {
        k: getattr(args, k)
        for k in ("num_layers", "moe_blocks", "num_experts", "seq_len", "batch_per_rank", "steps", "train_embedding")
    }
    per_rank = run_simulated(
        rank_case,
        2,
        args=(spec,),
        timeout_s=args.timeout_s,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
    )
    print(
        json.dumps(
            {
                "benchmark": "hf",
                "targets": TARGETS,
                **summarize(per_rank),
                "world": 2,
                "model": {**SMOLLM2, "num_hidden_layers": args.num_layers, "router": "top_k", "top_k": 1},
                "config": vars(args),
                "machine": machine_info(1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
