"""gpu-check section ``imported_moe``: an imported transformers MoE (a Qwen3-MoE checkpoint written by
bench/moe_checkpoint.py) trained the way a run trains it, on CUDA (NCCL, world size 1), against transformers'
own model of the same checkpoint on the same device and tokens.

  loss        the first float32 loss, ours (native routing, the trainer's step) against transformers'
              ``labels=`` loss (eager experts, no grouped matmul): the same checkpoint must give the same loss
  speed       bf16 autocast training steps, ours / transformers (median step), as bench hf-moe on CPU
  lora        the same run with ``[lora]`` on (attention + routed experts, rank 8): after two steps only the
              adapters moved, the base did not, and the loss went down

In the check's CPU rehearsal everything runs at toy sizes on the CPU (gloo), figures meaningless.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from dynmoe_dist.bench.hf_moe import MODERATE, TINY, run_config
from dynmoe_dist.bench.moe_checkpoint import write_checkpoint

BATCH, SEQ_LEN, STEPS = 8, 256, 5
REHEARSAL_BATCH, REHEARSAL_SEQ_LEN, REHEARSAL_STEPS = 2, 16, 2
LOSS_TOLERANCE = 1e-4  # relative, float32 on CUDA: the two sides sum the experts in different orders


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # NOTE: device-to-host sync: the step's end, for the timer


def _median_step_s(step: Callable[[], float], device: str, steps: int) -> float:
    seconds = []
    for _ in range(steps):
        _synchronize(device)
        started = time.perf_counter()
        step()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _theirs(directory: str, tokens_BL: torch.Tensor, device: str, steps: int) -> Dict:
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.bench.hf_moe import transformers_side

    model = AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager")
    model = model.to(device).train()  # type: ignore[arg-type]
    _, step = transformers_side(model, tokens_BL)
    with torch.no_grad():
        first_loss = float(model(input_ids=tokens_BL, labels=tokens_BL).loss)
    with torch.autocast(device, dtype=torch.bfloat16):
        step()  # warm-up: kernels, allocator, optimizer state
        step_s = _median_step_s(step, device, steps)
    return {"first_loss": first_loss, "step_s": step_s}


def _ours(directory: str, tokens_BL: torch.Tensor, vocab: int, device: str, steps: int, lora: bool) -> Dict:
    from dynmoe_dist.bench.hf_moe import ours_step
    from dynmoe_dist.models.build import build_model
    from dynmoe_dist.models.lora import expert_config
    from dynmoe_dist.tasks.base import ModelNeeds
    from dynmoe_dist.train.parts import build_parts

    config = run_config(directory, "auto")
    config.parallel.device = device
    config.parallel.backend = "nccl" if device == "cuda" else "gloo"
    if lora:
        config.lora.enabled = True
        config.lora.targets = ("attention", "routed_experts")
    needs = ModelNeeds("causal-lm", vocab)
    source = build_model(config.model, expert_config(config.moe, config.lora), needs)
    parts = build_parts(config, source)
    step = ours_step(parts, tokens_BL, tokens_BL.shape[0] * (tokens_BL.shape[1] - 1))
    if lora:
        return _lora_moves(parts.model, step)
    with torch.no_grad():
        first_loss = _first_loss(parts.model, tokens_BL)
    with torch.autocast(device, dtype=torch.bfloat16):
        step()
        step_s = _median_step_s(step, device, steps)
    return {"first_loss": first_loss, "step_s": step_s}


def _first_loss(model: torch.nn.Module, tokens_BL: torch.Tensor) -> float:
    logits_BLV = model(input_ids=tokens_BL)
    logits_BLV = getattr(logits_BLV, "logits", logits_BLV)
    return float(F.cross_entropy(logits_BLV[:, :-1].flatten(0, 1).float(), tokens_BL[:, 1:].flatten()))


def _lora_moves(model: torch.nn.Module, step: Callable[[], float]) -> Dict:
    """Two float32 steps: which parameters moved (only what trains must), and the losses."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    losses = [step(), step()]
    moved = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    return {
        "trainable": len(trains),
        "frozen": len(before) - len(trains),
        "frozen_moved": sorted(moved - trains)[:5],
        "adapters_moved": len(moved & trains),
        "losses": losses,
    }


def on_rank(directory: str, rehearsal: bool) -> Dict:
    """One spawned process (module level: the spawned processes import it)."""
    device = "cpu" if rehearsal else "cuda"
    batch, seq_len, steps = (
        (REHEARSAL_BATCH, REHEARSAL_SEQ_LEN, REHEARSAL_STEPS) if rehearsal else (BATCH, SEQ_LEN, STEPS)
    )
    shape = TINY if rehearsal else MODERATE
    g = torch.Generator().manual_seed(0)
    tokens_BL = torch.randint(0, shape.vocab, (batch, seq_len), generator=g).to(device)
    return {
        "theirs": _theirs(directory, tokens_BL, device, steps),
        "ours": _ours(directory, tokens_BL, shape.vocab, device, steps, lora=False),
        "lora": _ours(directory, tokens_BL, shape.vocab, device, steps, lora=True),
    }


def imported_moe(context: dict) -> Dict:
    from dynmoe_dist.parallel.simulate import run_simulated

    rehearsal = bool(context.get("rehearsal"))
    with tempfile.TemporaryDirectory(prefix="gpu-check-moe-") as work:
        directory = Path(work) / "checkpoint"
        write_checkpoint(directory, TINY if rehearsal else MODERATE, max_shard_bytes=2**30)
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        backend = "gloo" if rehearsal else "nccl"
        args = (str(directory), rehearsal)
        (result,) = run_simulated(on_rank, 1, args=args, backend=backend, timeout_s=100, env=env)
    return summarize(result)


def summarize(result: Dict) -> Dict:
    theirs, ours, lora = result["theirs"], result["ours"], result["lora"]
    difference = abs(ours["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"])
    failures: List[str] = []
    if difference > LOSS_TOLERANCE:
        failures.append(f"first loss {ours['first_loss']:.6f} vs transformers' {theirs['first_loss']:.6f}")
    if lora["frozen_moved"] or not lora["adapters_moved"]:
        failures.append(f"LoRA moved frozen {lora['frozen_moved']} / {lora['adapters_moved']} adapters")
    if failures:
        raise AssertionError("; ".join(failures))
    ratio = ours["step_s"] / theirs["step_s"]
    return {
        "first_loss_relative_difference": difference,
        "bf16_step_s": {"ours": round(ours["step_s"], 4), "transformers": round(theirs["step_s"], 4)},
        "ours_over_transformers": round(ratio, 3),
        "lora": lora,
        "summary": f"loss equal ({difference:.1e}); bf16 step ours/transformers {ratio:.2f}; LoRA trains only adapters",
    }
