"""`python -m dynmoe_dist.bench lora [--tiny] [--steps N] [--activation-checkpointing none|block|both] [--out FILE]
[sizes]`: peak memory per rank and step time of LoRA and QLoRA against a full finetune of the same imported MoE, and
our LoRA against PEFT's, every side under the same activation checkpointing.

The checkpoint is a Qwen3-MoE written by bench/moe_checkpoint.py (by default 4 layers of 16 experts, top-2,
hidden 512, moe_intermediate_size 1024, vocabulary 4096, 8 heads with 4 key/value heads: 108 M parameters, 101 M
of them experts; float32, random weights). The global batch is --batch sequences of --seq-len random tokens.

  cases     2 gloo ranks, one thread each, ep 2 (each rank holds half the experts, the dense weights
            replicated), the run as the config loader reads it (bench/lora_cases.py), ``build_model`` +
            ``build_parts``, the trainer's step: ``full`` (every weight trains, AdamW), ``lora`` (adapters of
            rank --rank on the attention projections and every routed expert, the base frozen in the run's
            dtype), ``lora_bf16`` (``lora.base_dtype = 'bfloat16'``), ``qlora`` (``'nf4'``). A case the config
            refuses is ``{"skipped": "<its one-line reason>"}``. All live in the same rank processes; 1 untimed
            step each, one measured for memory, then --steps timed ones, the cases' steps alternating.
  vs PEFT   one process, --threads torch threads, world 1: transformers' own model (``from_pretrained``, its
            default experts implementation) with PEFT's LoRA of the same rank, alpha and targets
            (``target_modules`` the attention projections, ``target_parameters`` experts.gate_up_proj and
            experts.down_proj: models/lora_export.peft_config) and bench hf-moe's transformers step, against
            ours (the ``lora`` case on 1 rank, the same tokens); steps alternating.

Activation checkpointing (--activation-checkpointing): every case and both sides of the PEFT comparison run with
the same setting: 'none', 'block' (train.activation_checkpointing = 'block' on ours, transformers'
``activation_checkpointing_enable`` on PEFT's: each decoder layer's activations recomputed in the backward pass, as
QLoRA and every LoRA recipe train), or 'both' (the default): each measured in its own processes, one after the
other, under ``settings.<setting>``, and ``checkpointing_effect`` says per side what 'block' saved and cost against
'none'. Both by default, because the issue's ratios mean different things under each: without checkpointing the
activations (the same for every case) fill most of a LoRA step's peak; with it the stored base does.

Memory per rank (bench/lora_cases.py): ``peak`` = held (parameters at their stored size + optimizer state)
+ the peak resident memory of one step above the memory before it; the largest rank's. Step time: the
slowest rank's, median over steps. Ratios against the full finetune (``against_full``) and ours over PEFT's
(``against_peft``), each with its target and ``meets_target`` (None where the issue sets no target).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import torch

from ..config import ACTIVATION_CHECKPOINTING
from .hf_moe import alternate, global_tokens
from .lora_cases import (
    CASES,
    LORA_TARGETS,
    build_case,
    ratio,
    refusal,
    run_overrides,
    side_report,
    summarize,
    timed_side,
)
from .lora_peft import TARGETS as PEFT_TARGETS
from .lora_peft import compare_peft, run_peft
from .measure import emit_json, machine_info
from .moe_checkpoint import Qwen3MoeShape, write_checkpoint

# case -> {measure: target ratio against the full finetune}; issue 30, item 6
TARGETS: Dict[str, Dict[str, float]] = {
    "lora": {"step_time": 1.0},
    "lora_bf16": {"peak": 0.35, "step_time": 1.0},
    "qlora": {"peak": 0.2},
}
DEFAULT = Qwen3MoeShape(
    num_layers=4, num_experts=16, top_k=2, hidden=512, moe_ffn=1024, vocab=4096, heads=8, kv_heads=4
)
TINY = Qwen3MoeShape(num_layers=2, num_experts=4, top_k=2, hidden=64, moe_ffn=64, vocab=128, heads=2, kv_heads=1)
# option -> (Qwen3MoeShape field, --tiny's batch/seq_len/rank where not a shape field)
SHAPE_OPTIONS = {
    "layers": "num_layers",
    "experts": "num_experts",
    "top_k": "top_k",
    "dim": "hidden",
    "ffn": "moe_ffn",
    "vocab": "vocab",
    "heads": "heads",
    "kv_heads": "kv_heads",
}
CHECKPOINTING = {**{setting: (setting,) for setting in ACTIVATION_CHECKPOINTING}, "both": ACTIVATION_CHECKPOINTING}
RUN_DEFAULTS = {"batch": (8, 4), "seq_len": (128, 16), "rank": (16, 4)}  # option -> (default, --tiny)
MIB = 2**20


# -- on the 2 ranks ------------------------------------------------------------------------------------------
def cases_on_rank(spec: Dict) -> Dict[str, Dict]:
    """One rank: every accepted case built, warmed up, its peak measured, then their timed steps alternating."""
    torch.set_num_threads(1)
    tokens_BL = global_tokens(spec)
    built = {name: build_case(sets, tokens_BL, spec["vocab"]) for name, sets in spec["cases"].items()}
    sides = {name: timed_side(case) for name, case in built.items()}
    alternate(sides.values(), spec["steps"])
    return {
        name: side_report(sides[name], case.parts.model, case.parts.optimizer, case.gradients)
        for name, case in built.items()
    }


def against_full(cases: Dict[str, Dict]) -> Dict[str, Dict]:
    """Each LoRA case's peak per rank and step time over the full finetune's, with the issue's targets."""
    full = cases["full"]
    out: Dict[str, Dict] = {}
    for name in CASES:
        if name == "full":
            continue
        skipped = cases[name].get("skipped") or full.get("skipped")
        if skipped:
            out[name] = {"skipped": skipped}
            continue
        targets = TARGETS.get(name, {})
        out[name] = {
            "peak": ratio(cases[name]["peak_mib_per_rank"], full["peak_mib_per_rank"], targets.get("peak")),
            "step_time": ratio(cases[name]["step_s_median"], full["step_s_median"], targets.get("step_time")),
        }
    return out


def run_cases(spec: Dict, timeout_s: float) -> Dict[str, Dict]:
    """Every case on 2 ranks (those the config refuses skipped, with its reason), summarized."""
    from ..parallel.simulate import run_simulated

    checkpointing = spec["activation_checkpointing"]
    sets = {
        name: run_overrides(spec["directory"], 2, dtype, spec["rank"], spec["alpha"], checkpointing)
        for name, dtype in CASES.items()
    }
    refused = {name: refusal(s) for name, s in sets.items()}
    accepted = {name: s for name, s in sets.items() if refused[name] is None}
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    per_rank = run_simulated(
        cases_on_rank,
        2,
        args=({**spec, "cases": accepted},),
        timeout_s=timeout_s,
        collective_timeout_s=timeout_s,
        env=env,
    )
    return {
        name: {"skipped": refused[name]} if name not in accepted else summarize([rank[name] for rank in per_rank])
        for name in CASES
    }


def measure_setting(spec: Dict, threads: int, timeout_s: float) -> Dict:
    """The cases on 2 ranks and the PEFT comparison under ``spec['activation_checkpointing']``, with their ratios."""
    cases = run_cases(spec, timeout_s)
    peft = run_peft({**spec, "threads": threads}, timeout_s)
    return {"cases": cases, "against_full": against_full(cases), "peft": peft, "against_peft": compare_peft(peft)}


def checkpointing_effect(settings: Dict[str, Dict]) -> Dict[str, Dict]:
    """Per side measured under both settings ('peft.ours', 'peft.peft' for the comparison's): its peak per rank and
    step time with activation checkpointing over without. Empty unless both were measured."""
    if set(settings) != set(ACTIVATION_CHECKPOINTING):
        return {}
    plain, checkpointed = (_sides(settings[setting]) for setting in ACTIVATION_CHECKPOINTING)
    return {
        name: {
            "peak": ratio(side["peak_mib_per_rank"], plain[name]["peak_mib_per_rank"], None),
            "step_time": ratio(side["step_s_median"], plain[name]["step_s_median"], None),
        }
        for name, side in checkpointed.items()
        if "skipped" not in side and "skipped" not in plain[name]
    }


def _sides(measured: Dict) -> Dict[str, Dict]:
    return {**measured["cases"], **{f"peft.{name}": measured["peft"][name] for name in ("ours", "peft")}}


# -- the command line ----------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="a tiny checkpoint, batch and rank: a smoke run (the test's)")
    p.add_argument("--layers", type=int, help=f"decoder layers, all sparse (default {DEFAULT.num_layers})")
    p.add_argument("--experts", type=int, help=f"experts per layer, >= 2: ep 2 (default {DEFAULT.num_experts})")
    p.add_argument("--top-k", type=int, help=f"experts per token (default {DEFAULT.top_k})")
    p.add_argument("--dim", type=int, help=f"hidden size (default {DEFAULT.hidden})")
    p.add_argument("--ffn", type=int, help=f"an expert's hidden size (default {DEFAULT.moe_ffn})")
    p.add_argument("--vocab", type=int, help=f"vocabulary (default {DEFAULT.vocab})")
    p.add_argument("--heads", type=int, help=f"attention heads (default {DEFAULT.heads})")
    p.add_argument("--kv-heads", type=int, help=f"key/value heads (default {DEFAULT.kv_heads})")
    p.add_argument("--batch", type=int, help="global batch, sequences, even: 2 ranks (default 8; --tiny 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128; --tiny 16)")
    p.add_argument("--rank", type=int, help="LoRA rank, ours and PEFT's (default 16; --tiny 4)")
    p.add_argument("--alpha", type=float, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per case, after 2 untimed ones")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the PEFT comparison's process")
    p.add_argument(
        "--activation-checkpointing",
        choices=tuple(CHECKPOINTING),
        default="both",
        help="train.activation_checkpointing of every case and PEFT's gradient checkpointing, the same for all; "
        "'both' measures each setting (default both)",
    )
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint into DIR and keep it")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--timeout-s", type=float, default=1800)
    return p


def resolve(args: argparse.Namespace) -> Dict:
    """The options with the preset's defaults filled in, checked: one-line ValueErrors naming the option."""
    base = TINY if args.tiny else DEFAULT
    shape = Qwen3MoeShape(
        **{field: getattr(args, option) or getattr(base, field) for option, field in SHAPE_OPTIONS.items()}
    )
    run = {k: getattr(args, k) or pair[1 if args.tiny else 0] for k, pair in RUN_DEFAULTS.items()}
    run["alpha"] = args.alpha or 2.0 * run["rank"]
    check(shape, run, args)
    return {"shape": shape, **run}


def check(shape: Qwen3MoeShape, run: Dict, args: argparse.Namespace) -> None:
    positive = {"--layers": shape.num_layers, "--top-k": shape.top_k, "--dim": shape.hidden, "--ffn": shape.moe_ffn}
    positive |= {"--vocab": shape.vocab, "--heads": shape.heads, "--kv-heads": shape.kv_heads, "--rank": run["rank"]}
    positive |= {"--steps": args.steps, "--threads": args.threads, "--alpha": run["alpha"]}
    for option, value in positive.items():
        _require(value > 0, f"{option} ({value}) must be > 0")
    _require(shape.num_experts >= 2, f"--experts ({shape.num_experts}) must be >= 2: ep 2 gives each rank one")
    _require(shape.top_k <= shape.num_experts, f"--top-k ({shape.top_k}) must be <= --experts ({shape.num_experts})")
    _require(shape.hidden % shape.heads == 0, f"--dim ({shape.hidden}) must be a multiple of --heads ({shape.heads})")
    _require(
        shape.heads % shape.kv_heads == 0,
        f"--heads ({shape.heads}) must be a multiple of --kv-heads ({shape.kv_heads})",
    )
    smallest = min(shape.hidden, shape.moe_ffn, shape.kv_heads * shape.hidden // shape.heads)
    _require(run["rank"] <= smallest, f"--rank ({run['rank']}) must be <= the smallest adapted dimension ({smallest})")
    _require(run["batch"] >= 2 and run["batch"] % 2 == 0, f"--batch ({run['batch']}) must be even and >= 2: 2 ranks")
    _require(run["seq_len"] >= 2, f"--seq-len ({run['seq_len']}) must be >= 2")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    try:
        options = resolve(args)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    shape = options["shape"]
    root = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    directory = Path(args.keep) if args.keep else root / "moe"
    try:
        described = write_checkpoint(directory, shape, max_shard_bytes=256 * MIB)
        spec = {"directory": str(directory), "vocab": shape.vocab, "seed": 0, "steps": args.steps}
        spec |= {k: options[k] for k in ("batch", "seq_len", "rank", "alpha")}
        settings = {
            setting: measure_setting({**spec, "activation_checkpointing": setting}, args.threads, args.timeout_s)
            for setting in CHECKPOINTING[args.activation_checkpointing]
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "lora",
        "targets": {"against_full": TARGETS, "against_peft": PEFT_TARGETS},
        "activation_checkpointing": list(settings),
        "settings": settings,
        "checkpointing_effect": checkpointing_effect(settings),
        "lora": {"rank": options["rank"], "alpha": options["alpha"], "targets": list(LORA_TARGETS)},
        "world": 2,
        "ep_size": 2,
        "checkpoint": described,
        "tokens": {"batch": options["batch"], "seq_len": options["seq_len"]},
        "steps": args.steps,
        "machine": machine_info(1),
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
