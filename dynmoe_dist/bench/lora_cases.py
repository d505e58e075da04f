"""bench lora's cases: the run of each (a full finetune, LoRA with the frozen base in the run's dtype, in
bfloat16, in NF4), as the config loader reads it (so a case the config refuses is reported with its one-line
reason instead of run), built and measured on a rank the way a run builds it (``build_model`` +
``build_parts``, the trainer's step).

Memory of a case on a rank, in MiB: ``held`` = its parameters (their stored bytes: an NF4 weight's codes and
scales, a bfloat16 weight's 2 bytes) + its optimizer state, what stays between steps; ``step_peak_rss`` = the
peak resident memory of one step above the resident memory before it (gradients, activations, buffers,
dequantised weights: bench memory's measure, taken after a heap trim so that heap another case freed cannot
hide it); ``peak`` = held + step_peak_rss, the figure the ratios compare.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from ..moe.adapters import is_adapter
from ..moe.nf4 import stored_bytes
from ..parallel.blocks import find_blocks, is_checkpointed
from ..parallel.fsdp import local
from .hf_moe import LR, WEIGHT_DECAY, Timed, step_times
from .measure import GradientsAtStep, optimizer_state, tensors_mib

if TYPE_CHECKING:
    from ..models.lora import LoraConfig
    from ..train.parts import TrainParts

# case -> lora.base_dtype (None: the full finetune, no [lora])
CASES: Dict[str, Optional[str]] = {"full": None, "lora": "run", "lora_bf16": "bfloat16", "qlora": "nf4"}
LORA_TARGETS = ("attention", "routed_experts")  # what PEFT's LoRA on the same model adapts (bench lora_peft)
MIB = 2**20


def run_overrides(
    directory: str, ep_size: int, base_dtype: Optional[str], rank: int, alpha: float, checkpointing: str = "none"
) -> List[str]:
    """The case's run as ``--set`` overrides of the config loader: the imported MoE at ``directory`` (its own
    routing), experts over ``ep_size`` ranks, bench hf-moe's AdamW, ``checkpointing`` its
    train.activation_checkpointing; with ``base_dtype`` the ``[lora]`` section."""
    sets = [
        "task.name='causal-lm'",
        "task.path='rotten-tomatoes'",  # the loader asks for a corpus; the benchmark feeds its own tokens
        "model.source='hf'",
        f"model.path='{directory}'",
        f"parallel.ep_size={ep_size}",
        f"train.lr={LR}",
        f"train.weight_decay={WEIGHT_DECAY}",
        f"train.activation_checkpointing='{checkpointing}'",
    ]
    if base_dtype is not None:
        targets = ", ".join(f"'{t}'" for t in LORA_TARGETS)
        sets += ["lora.enabled=true", f"lora.rank={rank}", f"lora.alpha={alpha}", f"lora.targets=[{targets}]"]
        sets.append(f"lora.base_dtype='{base_dtype}'")
    return sets


def refusal(sets: List[str]) -> Optional[str]:
    """The config loader's one-line reason for refusing the run, None where it accepts it."""
    from ..config import load_config

    try:
        load_config(None, sets)
    except ValueError as err:
        return str(err).splitlines()[0]
    return None


@dataclass
class Built:
    """One case built on this rank: what trains it, its step (returns this rank's share of the loss), its
    gradients read at the optimizer step."""

    parts: "TrainParts"
    lora: "LoraConfig"
    step: Callable[[], float]
    gradients: GradientsAtStep


def build_case(sets: List[str], tokens_BL: torch.Tensor, vocab: int) -> Built:
    """The run of ``sets`` on this rank, as the trainer builds it, on its share of the global batch."""
    from ..config import load_config
    from ..models.build import build_model
    from ..models.lora import expert_config
    from ..tasks.base import ModelNeeds
    from ..train.parts import build_parts
    from .hf_moe import ours_step

    config = load_config(None, sets)
    source = build_model(config.model, expert_config(config.moe, config.lora), ModelNeeds("causal-lm", vocab))
    parts = build_parts(config, source)
    mine_BL = tokens_BL.chunk(parts.groups.world_size)[parts.groups.rank]
    step = ours_step(parts, mine_BL, tokens_BL.shape[0] * (tokens_BL.shape[1] - 1))
    gradients = GradientsAtStep(parts.optimizer, {"all": list(parts.model.parameters())})
    return Built(parts, config.lora, step, gradients)


def stored_mib(params: List[torch.Tensor]) -> float:
    return sum(stored_bytes(local(p)) for p in params) / MIB


def what_trains(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict:
    """Parameter and tensor counts on this rank: all, trainable, adapters, and the tensors with optimizer state
    (a LoRA case must train its adapters and nothing else); the blocks whose activations the backward recomputes."""
    named = list(model.named_parameters())
    trainable = [p for _, p in named if p.requires_grad]
    return {
        "parameters": sum(p.numel() for _, p in named),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "trainable_tensors": len(trainable),
        "adapter_tensors": sum(1 for name, _ in named if is_adapter(name)),
        "optimizer_state_tensors": sum(1 for _, p in named if optimizer.state.get(p)),
        "checkpointed_blocks": checkpointed_blocks(model),
    }


def checkpointed_blocks(model: nn.Module) -> int:
    """The model's transformer blocks that activation checkpointing replays: ours (train.activation_checkpointing)
    or transformers' own (``activation_checkpointing_enable``, PEFT's side)."""
    return sum(
        1 for block in find_blocks(model) if is_checkpointed(block) or getattr(block, "gradient_checkpointing", False)
    )


def held_memory(model: nn.Module, optimizer: torch.optim.Optimizer, gradients: GradientsAtStep) -> Dict:
    """MiB this rank holds between steps (frozen and trainable parameters, optimizer state) and the gradients
    it held at the optimizer step (inside the step's peak, reported apart)."""
    params = list(model.parameters())
    frozen = stored_mib([p for p in params if not p.requires_grad])
    trainable = stored_mib([p for p in params if p.requires_grad])
    state = tensors_mib(optimizer_state(optimizer, params))
    return {
        "frozen_parameters_mib": round(frozen, 2),
        "trainable_parameters_mib": round(trainable, 2),
        "optimizer_state_mib": round(state, 2),
        "gradients_mib": round(gradients.mib["all"], 2),
        "held_mib": round(frozen + trainable + state, 2),
    }


def side_report(timed: Timed, model: nn.Module, optimizer: torch.optim.Optimizer, gradients: GradientsAtStep) -> Dict:
    """One side on this rank after its steps: times and first loss (``timed``), memory, what trains."""
    held = held_memory(model, optimizer, gradients)
    return {
        "wall": timed.wall,
        "cpu": timed.cpu,
        "first_loss": timed.first_loss,
        **held,
        "step_peak_rss_mib": timed.peak_mib,
        "peak_mib": round(held["held_mib"] + timed.peak_mib, 2),
        **what_trains(model, optimizer),
    }


def timed_side(built: Built) -> Timed:
    """A built case's step, to be timed; its peak measured after a heap trim (hf_moe.Timed)."""
    from ..parallel.groups import barrier

    return Timed(built.step, functools.partial(barrier, built.parts.groups, "bench lora step"), trim=True)


def summarize(per_rank: List[Dict]) -> Dict:
    """One side over its ranks: hf_moe.step_times, the largest rank's memory, every rank's counts."""
    memory = [k for k in per_rank[0] if k.endswith("_mib")]
    counts = (
        "parameters",
        "trainable_parameters",
        "trainable_tensors",
        "adapter_tensors",
        "optimizer_state_tensors",
        "checkpointed_blocks",
    )
    return {
        **step_times(per_rank),
        **{f"{k}_per_rank": max(r[k] for r in per_rank) for k in memory},
        **{f"{k}_by_rank": [r[k] for r in per_rank] for k in counts},
    }


def ratio(value: float, reference: float, target: Optional[float]) -> Dict:
    """value / reference, shown to 3 decimals; the target is judged on the exact ratio (0.3505 is not <= 0.35,
    though it prints as 0.35)."""
    exact = value / reference
    return {"ratio": round(exact, 3), "target": target, "meets_target": None if target is None else exact <= target}
