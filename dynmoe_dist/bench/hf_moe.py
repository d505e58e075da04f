"""`python -m dynmoe_dist.bench hf-moe [--tiny] [--steps N] [--profile] [--out FILE]`: the training step of an
imported transformers MoE against the same checkpoint trained the plain transformers way, on the same tokens.

The checkpoint is a Qwen3-MoE written by bench/moe_checkpoint.py (4 layers of 16 experts, top-2, hidden 256,
moe_intermediate_size 768, vocabulary 4096, 4 heads with 2 key/value heads; float32; random weights, norms
1): the experts' matmuls are about 70 % of a step's FLOPs (the LM head 15 %). The global batch is --batch
sequences of --seq-len random tokens, the same for both.

  transformers  one process, 2 torch threads: ``AutoModelForCausalLM.from_pretrained`` (its default experts
                implementation, torch._grouped_mm on CPU), ``torch.optim.AdamW`` over every parameter, its
                own loss (``labels=``).
  ours          2 gloo ranks, one thread each: a RunConfig with model.path = the checkpoint (native routing,
                experts expert-parallel over both ranks, dense weights replicated), ``build_model`` +
                ``build_parts``; each rank trains on its half of the batch, loss = its token losses summed /
                the global token count (the gradients sum to the one-process gradient). Twice, in the same
                processes, steps alternating: ``moe.expert_compute = "auto"`` (a per-expert loop on CPU, the
                default) and ``"grouped_mm"`` (torch._grouped_mm).

The two sides run one after the other, never at the same time (2 cores). Each takes 2 untimed steps, then
--steps timed ones; a step is forward, loss, backward, (ours: gradient sync), the AdamW step and zero_grad
(ours: the trainer's step, train/step.py).
A step's time is the slowest rank's (after a barrier); the figure is the median over steps. ``cpu_s`` is
the process CPU time of a step summed over ranks (all threads, gloo's included), steadier than wall time on
a shared machine. Memory per rank, in MiB: ``state`` = parameters + gradients + AdamW state held, and
``step_peak_rss`` = peak resident memory of one step above the resident memory before it (glibc's default
malloc, as bench hf: the fixed mmap threshold of the memory benchmarks doubled the step times here, every
allocation becoming fresh pages, so this figure can hide memory glibc reuses). The first step's losses must
agree (same weights, same tokens, same routing). Target: ours / transformers <= 1.0.
--profile adds, per side (rank 0), where a step's time goes: phases, the MoE blocks' parts and the busiest
operators (bench/step_profile.py).
"""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Tuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ..config import RunConfig, from_dict, model_source_defaults, resolve_num_layers
from .measure import (
    GradientsAtStep,
    emit_json,
    machine_info,
    memory_supported,
    peak_rss_above_baseline_mb,
    state_mib,
    trim_heap,
)
from .moe_checkpoint import Qwen3MoeShape, write_checkpoint
from .step_profile import profile_steps

TARGET = 1.0
MODERATE = Qwen3MoeShape(
    num_layers=4, num_experts=16, top_k=2, hidden=256, moe_ffn=768, vocab=4096, heads=4, kv_heads=2
)
TINY = Qwen3MoeShape(num_layers=2, num_experts=4, top_k=2, hidden=32, moe_ffn=48, vocab=128, heads=2, kv_heads=1)
OURS = {"ours": "auto", "ours_grouped_mm": "grouped_mm"}  # case -> moe.expert_compute
MIB = 2**20
LR, WEIGHT_DECAY = 1e-4, 0.01


def global_tokens(spec: Dict) -> torch.Tensor:
    """The global batch (B, L), the same for both sides."""
    g = torch.Generator().manual_seed(spec["seed"])
    return torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=g)


class Timed:
    """One side's step on this process, with its wall and CPU times, first loss and one step's peak memory
    (with ``trim``, measured after a gc and a heap trim: pages the step touches count, not heap another
    side's step freed; bench lora, whose sides differ in memory several times over)."""

    def __init__(self, step: Callable[[], float], barrier: Callable[[], None], trim: bool = False):
        self.step, self.barrier, self.trim = step, barrier, trim
        self.wall: List[float] = []
        self.cpu: List[float] = []
        self.first_loss = 0.0
        self.peak_mib: float = float("nan")

    def warm_up(self) -> None:
        self.first_loss = self.step()  # the checkpoint's weights: both sides must agree here
        if memory_supported():  # the second step: optimizer state exists, allocator warm
            if self.trim:
                gc.collect()
                trim_heap()
            self.peak_mib = peak_rss_above_baseline_mb(self._step_once)

    def _step_once(self) -> None:
        self.step()

    def timed(self) -> None:
        self.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        self.step()
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)


def alternate(sides: Iterable[Timed], steps: int) -> None:
    """Every side warmed up, then ``steps`` rounds of one timed step each: load that drifts hits all alike."""
    sides = list(sides)
    for side in sides:
        side.warm_up()
    for _ in range(steps):
        for side in sides:
            side.timed()


# -- transformers' way ---------------------------------------------------------------------------------
def transformers_side(model: torch.nn.Module, tokens_BL: torch.Tensor) -> Tuple[torch.optim.Optimizer, Callable]:
    """The baseline's own step (AdamW over every parameter, the model's own ``labels=`` loss), freeing its
    gradients after it as ours does; the one training step outside train/ (tests/unit/test_layering.py)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step() -> float:
        with record_function("phase: forward"):
            loss = model(input_ids=tokens_BL, labels=tokens_BL).loss
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return optimizer, step


def transformers_process(spec: Dict) -> Dict:
    """One process, 2 threads: from_pretrained, AdamW, the model's own loss."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["directory"]).train()
    tokens = global_tokens(spec)
    optimizer, step = transformers_side(model, tokens)
    gradients = GradientsAtStep(optimizer, {"all": list(model.parameters())})
    side = Timed(step, barrier=lambda: None)
    side.warm_up()
    for _ in range(spec["steps"]):
        side.timed()
    return {
        "experts_implementation": str(getattr(model.config, "_experts_implementation", None)),
        "threads": torch.get_num_threads(),
        "wall": side.wall,
        "cpu": side.cpu,
        "first_loss": side.first_loss,
        "state_mib": state_mib(model, optimizer, gradients),
        "step_peak_rss_mib": side.peak_mib,
        "profile": profile_steps(step, model) if spec["profile"] else None,
    }


# -- ours --------------------------------------------------------------------------------------------------
def run_config(directory: str, expert_compute: str) -> RunConfig:
    """The imported run: its routing, expert count and MoE blocks from config.json (as load_config fills
    them), experts over the whole world, dense weights replicated; AdamW at the transformers side's rate."""
    data: Dict = {
        "model": {"source": "hf", "path": directory},
        "moe": {"expert_compute": expert_compute},
        "train": {"lr": LR, "weight_decay": WEIGHT_DECAY},
    }
    model_source_defaults(data)
    config = from_dict(data)
    resolve_num_layers(config.model)
    return config


def ours_step(parts, tokens_BL: torch.Tensor, num_predictions: int) -> Callable[[], float]:
    """The trainer's step (train/step.py) on this rank's sequences: the whole sequences in, as transformers'
    side, the next tokens as targets (the last position's padded out, as transformers' ``labels=`` does);
    the loss is its share of the global mean (summed token losses / the global count). Returns that share."""
    from ..tasks.causal_lm import next_token_terms
    from ..train.step import MicroBatch, StepTotals, train_step

    targets_BL = F.pad(tokens_BL[:, 1:], (0, 1), value=-100)
    batch = MicroBatch({"input_ids": tokens_BL}, targets_BL, num_predictions)

    def step() -> float:
        totals = StepTotals(parts.groups.device)
        train_step(parts, [batch], next_token_terms, 1, totals)
        return totals.loss()

    return step


def ours_side(spec: Dict) -> Dict:
    """One rank: both expert-compute modes built from the checkpoint, their steps alternating."""
    from ..models.build import build_model
    from ..parallel.groups import barrier
    from ..tasks.base import ModelNeeds
    from ..train.parts import build_parts

    torch.set_num_threads(1)
    tokens = global_tokens(spec)
    num_predictions = tokens.shape[0] * (tokens.shape[1] - 1)
    sides: Dict[str, Timed] = {}
    steps: Dict[str, Callable[[], float]] = {}
    parts_of, gradients = {}, {}
    for name, mode in OURS.items():
        config = run_config(spec["directory"], mode)
        parts = build_parts(config, build_model(config.model, config.moe, ModelNeeds("causal-lm", spec["vocab"])))
        mine = tokens.chunk(parts.groups.world_size)[parts.groups.rank]  # this rank's sequences
        parts_of[name], steps[name] = parts, ours_step(parts, mine, num_predictions)
        gradients[name] = GradientsAtStep(parts.optimizer, {"all": list(parts.model.parameters())})
        sides[name] = Timed(steps[name], barrier=functools.partial(barrier, parts.groups, "bench hf-moe step"))
    alternate(sides.values(), spec["steps"])
    return {
        name: {
            "wall": side.wall,
            "cpu": side.cpu,
            "first_loss": side.first_loss,
            "state_mib": state_mib(parts_of[name].model, parts_of[name].optimizer, gradients[name]),
            "step_peak_rss_mib": side.peak_mib,
            "profile": profile_steps(steps[name], parts_of[name].model) if spec["profile"] else None,
        }
        for name, side in sides.items()
    }


# -- the comparison ----------------------------------------------------------------------------------------
def step_times(per_rank: List[Dict]) -> Dict:
    """Slowest rank per step (wall), summed over ranks (CPU), medians; the first loss summed over ranks (each
    holds its share of the global mean)."""
    wall = [max(step) for step in zip(*(r["wall"] for r in per_rank))]
    cpu = [sum(step) for step in zip(*(r["cpu"] for r in per_rank))]
    return {
        "ranks": len(per_rank),
        "step_s_median": round(statistics.median(wall), 4),
        "step_s_min": round(min(wall), 4),
        "cpu_s_median": round(statistics.median(cpu), 4),
        "first_loss": sum(r["first_loss"] for r in per_rank),
    }


def summarize_side(per_rank: List[Dict]) -> Dict:
    """``step_times``; memory: the largest rank's."""
    return {
        **step_times(per_rank),
        "state_mib_per_rank": max(r["state_mib"] for r in per_rank),
        "step_peak_rss_mib_per_rank": max(r["step_peak_rss_mib"] for r in per_rank),
        "profile_rank0": per_rank[0]["profile"],
    }


def compare(theirs: Dict, ours: Dict[str, Dict]) -> Dict:
    """Each of our cases over transformers' step (wall median and CPU), the target on the default case, and
    how far the first losses are apart."""
    out: Dict = {}
    for name, case in ours.items():
        out[f"{name}_over_transformers"] = round(case["step_s_median"] / theirs["step_s_median"], 3)
        out[f"{name}_over_transformers_cpu"] = round(case["cpu_s_median"] / theirs["cpu_s_median"], 3)
    out["meets_target"] = out["ours_over_transformers"] <= TARGET
    fastest = min(OURS, key=lambda name: ours[name]["step_s_median"])
    out["faster_expert_compute"] = OURS[fastest]
    out["first_loss_max_relative_difference"] = max(
        abs(case["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"]) for case in ours.values()
    )
    return out


def run_sides(spec: Dict, timeout_s: float) -> Dict:
    """transformers' side first, then ours: never both at once."""
    from ..parallel.simulate import run_simulated

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    threads = {**env, "OMP_NUM_THREADS": str(spec["threads"])}
    (theirs,) = run_simulated(transformers_process, 1, args=(spec,), timeout_s=timeout_s, env=threads)
    ours = run_simulated(ours_side, 2, args=(spec,), timeout_s=timeout_s, env=env)
    cases = {"transformers": {**summarize_side([theirs]), "experts_implementation": theirs["experts_implementation"]}}
    cases |= {name: summarize_side([rank[name] for rank in ours]) for name in OURS}
    return {"cases": cases, **compare(cases["transformers"], {name: cases[name] for name in OURS})}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench hf-moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="a tiny checkpoint and batch: a smoke run")
    p.add_argument("--batch", type=int, help="global batch, sequences (default 8; --tiny 4); even: 2 ranks")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128; --tiny 16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side, after 2 untimed ones")
    p.add_argument("--profile", action="store_true", help="also profile one step of each side (rank 0)")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint into DIR and keep it")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--timeout-s", type=float, default=1800)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    shape = TINY if args.tiny else MODERATE
    batch = args.batch or (4 if args.tiny else 8)
    seq_len = args.seq_len or (16 if args.tiny else 128)
    if batch < 2 or batch % 2 or seq_len < 2 or args.steps < 1:
        raise SystemExit(
            f"--batch ({batch}) must be even and >= 2, --seq-len ({seq_len}) >= 2, --steps ({args.steps}) >= 1"
        )
    root = Path(tempfile.mkdtemp(prefix="bench_hf_moe_"))
    directory = Path(args.keep) if args.keep else root / "moe"
    try:
        described = write_checkpoint(directory, shape, max_shard_bytes=256 * MIB)
        spec = dict(directory=str(directory), vocab=shape.vocab, batch=batch, seq_len=seq_len, seed=0)
        spec |= dict(steps=args.steps, threads=2, profile=args.profile)
        compared = run_sides(spec, args.timeout_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "hf-moe",
        "target": f"ours (expert_compute auto) / transformers step time <= {TARGET}",
        **compared,
        "checkpoint": described,
        "tokens": {"batch": batch, "seq_len": seq_len, "per_step": batch * seq_len},
        "steps": args.steps,
        "machine": machine_info(2),
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
