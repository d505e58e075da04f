"""bench lora against PEFT: our LoRA on 1 rank and PEFT's LoRA on transformers' own model, in one process with
the same threads, on the same checkpoint, tokens, rank, alpha and targets.

PEFT's side: ``AutoModelForCausalLM.from_pretrained`` (float32, its default experts implementation:
torch._grouped_mm on CPU), ``get_peft_model`` with models/lora_export.peft_config of our run (what our
``--adapter`` export writes: ``target_modules`` our adapted attention projections by name,
``target_parameters`` experts.gate_up_proj and experts.down_proj), and bench hf-moe's transformers step
(AdamW over the model's parameters: the frozen ones get no gradient, hence no state; its ``labels=`` loss).
Ours: the ``lora`` case of bench/lora_cases.py on a world of 1. Activation checkpointing is the same on both
sides: train.activation_checkpointing = 'block' on ours, ``activation_checkpointing_enable`` on PEFT's. Both
start with B = 0, so their first losses are the checkpoint's and must agree. Memory and counts as
bench/lora_cases.py measures them.
"""

from __future__ import annotations

from typing import Any, Dict, cast

import torch

from .hf_moe import Timed, alternate, global_tokens, transformers_side
from .lora_cases import CASES, build_case, ratio, run_overrides, side_report, summarize, timed_side
from .measure import GradientsAtStep

TARGETS = {"peak": 1.0, "step_time": 1.0}  # ours / PEFT's, issue 30 item 6


def peft_side(directory: str, ours_model: torch.nn.Module, lora, tokens_BL: torch.Tensor, checkpointing: str):
    """PEFT's LoRA of ``lora`` (our run's options, on the modules ``ours_model`` adapted) on transformers' model;
    ``checkpointing`` 'block' is transformers' own gradient checkpointing of every decoder layer (non-reentrant, as
    ours), the way PEFT's recipes turn it on."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from ..models.lora_export import peft_config

    model = AutoModelForCausalLM.from_pretrained(directory).train()
    if checkpointing == "block":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # our adapted modules by their names in the transformers model ours wraps, as our --adapter export names them
    peft = get_peft_model(model, peft_config(cast(Any, ours_model).transformers_model(), lora, directory))
    optimizer, step = transformers_side(peft, tokens_BL)
    implementation = str(getattr(model.config, "_experts_implementation", None))
    return peft, optimizer, step, implementation


def peft_process(spec: Dict) -> Dict:
    """One process of ``spec['threads']`` threads: ours (1 rank) and PEFT's, steps alternating."""
    torch.set_num_threads(spec["threads"])
    tokens_BL = global_tokens(spec)
    checkpointing = spec["activation_checkpointing"]
    sets = run_overrides(spec["directory"], 1, CASES["lora"], spec["rank"], spec["alpha"], checkpointing)
    ours = build_case(sets, tokens_BL, spec["vocab"])
    peft, optimizer, step, implementation = peft_side(
        spec["directory"], ours.parts.model, ours.lora, tokens_BL, checkpointing
    )
    gradients = GradientsAtStep(optimizer, {"all": list(peft.parameters())})
    sides = {"ours": timed_side(ours), "peft": Timed(step, barrier=lambda: None, trim=True)}
    alternate(sides.values(), spec["steps"])
    return {
        "ours": side_report(sides["ours"], ours.parts.model, ours.parts.optimizer, ours.gradients),
        "peft": {
            **side_report(sides["peft"], peft, optimizer, gradients),
            "experts_implementation": implementation,
        },
        "threads": torch.get_num_threads(),
    }


def run_peft(spec: Dict, timeout_s: float) -> Dict:
    """The comparison's process (world 1), each side summarized like bench lora's cases."""
    from ..parallel.simulate import run_simulated

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": str(spec["threads"])}
    (done,) = run_simulated(peft_process, 1, args=(spec,), timeout_s=timeout_s, collective_timeout_s=timeout_s, env=env)
    out = {name: summarize([done[name]]) for name in ("ours", "peft")}
    out["peft"]["experts_implementation"] = done["peft"]["experts_implementation"]
    out["threads"] = done["threads"]
    return out


def compare_peft(sides: Dict) -> Dict:
    """Ours over PEFT's: peak memory and step time, each with its target; how far the first losses are apart."""
    ours, peft = sides["ours"], sides["peft"]
    return {
        "peak": ratio(ours["peak_mib_per_rank"], peft["peak_mib_per_rank"], TARGETS["peak"]),
        "step_time": ratio(ours["step_s_median"], peft["step_s_median"], TARGETS["step_time"]),
        "first_loss_relative_difference": abs(ours["first_loss"] - peft["first_loss"]) / abs(peft["first_loss"]),
        # the same rank and targets adapt the same weights: as many trainable numbers on both sides
        "same_trainable_parameters": ours["trainable_parameters_by_rank"] == peft["trainable_parameters_by_rank"],
    }
