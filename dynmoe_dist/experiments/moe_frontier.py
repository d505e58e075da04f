"""`python -m dynmoe_dist.experiments moe-frontier --model DIR [--seeds 3] [--out OUT] [--tiny]`: held-out loss
against expert FLOPs per token for every router at several budgets, on a pre-trained MoE.

The pre-trained checkpoint (`pretrain-moe`: a Qwen3-MoE trained top-2 of 16 experts) is finetuned on the Rotten
Tomatoes snippets with `moe-finetune`'s batch, lr, data order and held-out split for one epoch (FRONTIER), one
run per (router, budget, seed):
  native-kK      the model's own rule (softmax, top-K, renormalised) at K = 1, 2, 3: the checkpoint with its
                 config.json's num_experts_per_tok set to K (its weights linked, not copied), as a user of
                 transformers would run it
  top-p-P        routers converted to top-p (Huang et al.) at mass P
  top-any-T      routers converted to DynMoE's top-any, moe.target_k = T (the budget controller holds the mean
                 k there; calibration starts at T), with pruning (adaptive events that only remove)
  top-any-top1-T the same with moe.train_k0 = 'top1': a token that clears no threshold trains through its
                 top-1 expert (as it is evaluated) instead of skipping the layer, and the budget counts it
  top-k2-aux     routers converted to top-k 2 with the switch load-balance loss (its default), and
  top-k2-bias    the same with DeepSeek-V3's aux-loss-free balance (moe.balance = 'bias') and no aux loss:
                 load coefficient of variation and held-out loss of the two balance rules
Expert FLOPs per token follow the k each run's exported model computes (its k at the final evaluation);
frontier_report.py draws the figure and decides, budget by budget, whether top-any pays. No export or
generation timing: `moe-finetune` measures those. Writes OUT/frontier.json, OUT/frontier.md and
OUT/frontier.png; finished runs are reused on the next call.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..config import RunConfig
from ..models.hf.topk_view import model_with_k
from ..train.cli import exit_usage_error
from .moe_finetune import FULL, TINY, Plan, check_model, train_config
from .moe_report import aggregate_variant
from .moe_runs import log

NATIVE_KS = (1, 2, 3)
TOP_PS = (0.3, 0.45, 0.6)
"""Chosen from the pre-trained model's k before any step (held-out data, 2026-12-04): p 0.3, 0.45, 0.6, 0.75 and
0.9 route 1.31, 1.89, 2.83, 4.44 and 7.71 experts per token, so these three span native top-1 to top-3."""
TARGET_KS = (1.0, 1.25, 1.5, 1.75, 2.0)
TOP1_TARGET_KS = (1.25, 1.5)
"""The budgets where top-any's tokens that choose nothing cost it most (8-19 % and 3-11 % of a layer's
tokens at the end of the plain runs); at 1.0 train_k0 'top1' leaves the thresholds nothing to choose."""
TOP_ANY_COMBINE = "softmax"
"""The router's probabilities renormalised over the chosen experts: moe-finetune measured it the better rule
for this model at step 0 (6.593 against 6.643 for DynMoE's 1/k)."""
PRUNING_ONLY = ("adaptive.max_adds_per_event=0",)
FRONTIER = replace(FULL, epochs=1, world_size=1)
"""moe-finetune's sizes for one epoch (72 steps, one adaptive window: steps 24-48) in one process: 39 runs
have to fit on 2 cores beside other work. One process trains what 2 or 3 ranks train (the world-size
invariance tests); moe-finetune measures the 2-epoch, 2-rank runs."""


@dataclass(frozen=True)
class Variant:
    """One router at one budget. ``family``: 'native', 'top_p', 'top_any' (the frontier's points) or 'balance'
    (the balance study's pair, off the frontier)."""

    name: str
    label: str
    family: str
    router: str
    adaptive: bool
    native_k: int = 0
    """native only: the checkpoint's num_experts_per_tok is set to this (0: the model's own)."""
    overrides: Tuple[str, ...] = ()


def variants() -> List[Variant]:
    found = [Variant(f"native-k{k}", f"native top-{k}", "native", "native", False, native_k=k) for k in NATIVE_KS]
    found += [
        Variant(f"top-p-{p:g}", f"top-p {p:g}", "top_p", "top_p", False, overrides=(f"moe.top_p={p}",)) for p in TOP_PS
    ]
    found += [
        Variant(
            f"top-any-{t:g}",
            f"top-any, target k {t:g}",
            "top_any",
            "top_any",
            True,
            overrides=(f"moe.target_k={t}", f"moe.combine='{TOP_ANY_COMBINE}'", *PRUNING_ONLY),
        )
        for t in TARGET_KS
    ]
    found += [
        Variant(
            f"top-any-top1-{t:g}",
            f"top-any, target k {t:g}, train_k0 top1",
            "top_any_top1",
            "top_any",
            True,
            overrides=(f"moe.target_k={t}", f"moe.combine='{TOP_ANY_COMBINE}'", "moe.train_k0='top1'", *PRUNING_ONLY),
        )
        for t in TOP1_TARGET_KS
    ]
    found += [
        Variant("top-k2-aux", "top-k 2 + switch aux loss", "balance", "top_k", False, overrides=("moe.top_k=2",)),
        Variant(
            "top-k2-bias",
            "top-k 2 + bias balance (no aux loss)",
            "balance",
            "top_k",
            False,
            overrides=("moe.top_k=2", "moe.balance='bias'", "moe.aux_losses=[]"),
        ),
    ]
    return found


def run_config(plan: Plan, variant: Variant, seed: int) -> RunConfig:
    model = model_with_k(plan.model, variant.native_k, plan.out / "models")
    at_k = replace(plan, model=model)
    where = plan.out / "runs" / variant.name / f"seed{seed}"
    return at_k.config(variant.router, variant.adaptive, seed, where, TOP_ANY_COMBINE, variant.overrides)


def run_plan(plan: Plan, chosen: Sequence[Variant], reuse: bool) -> Dict[str, Any]:
    """Every (seed, variant) finetune, seeds outermost (an interrupted call has whole seeds done); the rows
    aggregated over seeds, FLOPs relative to the model's own top-k."""
    runs: Dict[str, list] = {v.name: [] for v in chosen}
    for seed in plan.seeds:
        for variant in chosen:
            config = run_config(plan, variant, seed)
            runs[variant.name].append(train_config(plan, variant.name, config, seed, float("nan"), reuse, export=False))
    info = plan.model_info
    dims = (info["dim"], info["ffn_dim"], info["top_k"], info["matmuls"])
    rows = [aggregate_variant(v.name, v.label, runs[v.name], *dims) for v in chosen]
    return {"rows": rows, "families": {v.name: v.family for v in chosen}}


# ----------------------------------------------------------------------------------------------------
# CLI


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", required=True, help="the pre-trained MoE checkpoint (pretrain-moe's DIR)")
    p.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 (default 3)")
    p.add_argument(
        "--seed-list",
        default="",
        help="run only these seeds, e.g. '2' or '0,1' (one command per seed runs them side by side; a last call "
        "with --seeds reuses them and writes the report over all)",
    )
    p.add_argument("--out", default="runs/moe_frontier", help="output directory (default runs/moe_frontier)")
    p.add_argument("--only", nargs="+", default=(), metavar="VARIANT", help="run these variants only (names above)")
    p.add_argument("--tiny", action="store_true", help="40 snippets, 16-token windows: seconds per run (tests)")
    p.add_argument("--world-size", type=int, default=0, help="simulated ranks per run (default 1: in this process)")
    p.add_argument("--no-reuse", dest="reuse", action="store_false", help="re-run finished runs too")
    return p


def model_shape(config: RunConfig) -> Dict[str, int]:
    """D, F and matmuls per expert (gated: 3) of the model a run config imports, from its config.json."""
    from ..models.source import decided_options

    decided = decided_options(config.model.path, config.moe)
    kind = decided["moe.expert_kind"]
    return {"dim": decided["model.dim"], "ffn_dim": decided["model.ffn_dim"], "matmuls": 2 if kind == "ffn" else 3}


def seed_list(args) -> List[int]:
    if not args.seed_list:
        return list(range(args.seeds))
    try:
        seeds = [int(part) for part in args.seed_list.split(",")]
    except ValueError:
        raise ValueError(f"--seed-list ({args.seed_list!r}) must be seeds separated by commas, e.g. '0,1'") from None
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seed-list ({args.seed_list!r}) must be distinct seeds >= 0")
    return seeds


def make_plan(args, every: Sequence[Variant]) -> Tuple[Plan, List[Variant]]:
    """The plan and the variants ``--only`` keeps of ``every``; every config loaded (one-line ValueErrors)."""
    if args.seeds < 1:
        raise ValueError(f"--seeds ({args.seeds}) must be >= 1")
    if args.world_size < 0:
        raise ValueError(f"--world-size ({args.world_size}) must be >= 1 (0 = the default, 1)")
    info = check_model(args.model)
    unknown = sorted(set(args.only) - {v.name for v in every})
    if unknown:
        raise ValueError(
            f"--only ({', '.join(unknown)}) names no variant; choose from {', '.join(v.name for v in every)}"
        )
    chosen = [v for v in every if not args.only or v.name in args.only]
    sizes = TINY if args.tiny else FRONTIER
    sizes = replace(sizes, world_size=args.world_size or sizes.world_size)
    plan = Plan(Path(args.model), Path(args.out), seed_list(args), sizes, info)
    plan = replace(plan, model_info={**info, **model_shape(run_config(plan, chosen[0], 0))})
    if any(v.native_k > info["num_experts"] for v in chosen):
        raise ValueError(f"--model ({args.model!r}) has {info['num_experts']} experts: too few for native top-3")
    for seed in plan.seeds:  # every config must load before the first run starts
        for variant in chosen:
            run_config(plan, variant, seed)
    return plan, chosen


Writer = Callable[[Path, Dict[str, Any], str, Dict[str, Any]], Dict[str, Path]]


def run_cli(
    argv: Optional[Sequence[str]], prog: str, doc: str, every: Sequence[Variant], write: Writer
) -> Dict[str, Any]:
    """The CLI of moe-frontier and moe-lora: parse, plan (usage errors in one line), run, write, print."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog, doc.split("\n\n")[0]).parse_args(argv)
    try:
        plan, chosen = make_plan(args, every)
    except ValueError as err:
        exit_usage_error(prog, err)
    started = time.perf_counter()
    outcome = run_plan(plan, chosen, args.reuse)
    log(f"{len(chosen) * len(plan.seeds)} runs in {time.perf_counter() - started:.0f}s")
    command = f"python -m dynmoe_dist.experiments {prog.split()[-1]} {shlex.join(argv)}".strip()
    paths = write(plan.out, outcome, command, plan.model_info)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"plan": plan, **outcome, "paths": paths}


def main(argv: Optional[Sequence[str]] = None, prog: str = "moe-frontier") -> Dict[str, Any]:
    from .frontier_report import write_outputs

    return run_cli(argv, prog, __doc__ or "", variants(), write_outputs)
