"""How far an upcycled run's experts moved in finetuning: away from the pre-trained MLP they were copied
from (drift) and away from one another (spread).

    python -m dynmoe_dist.experiments drift RUN_DIR [RUN_DIR ...] [--blocks 4,5]   # one JSON line per run
    python -m dynmoe_dist.experiments drift --compare runs/compare-minilm           # a markdown table

Why: an upcycled layer starts as N copies of one pre-trained MLP, and with combine weights that sum to 1
it computes exactly that MLP. It can do better than the dense finetune only once its experts differ, so
the spread says whether a finetune was long enough for upcycling to show.

For one MoE block with pre-trained MLP parameters W0 (all of them, flattened) and final experts W_e:
drift_e = |W_e - W0| / |W0| and spread_e = |W_e - mean_e W_e| / |W0| (Frobenius norms). A dense run (no
MoE layer) has one "expert", its own MLP: drift only. A run reads its last complete checkpoint; the
pre-trained MLP comes from building the run's model without MoE layers (models/hf/adapters.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..config import RunConfig
from ..models.build import build_model
from ..models.hf.adapters import find_mlps
from ..tasks import build_task
from ..train.checkpoint import (
    complete_checkpoints,
    last_complete_checkpoint,
    read_checkpoint_dense,
    read_checkpoint_experts,
    read_checkpoint_meta,
    saved_expert_counts,
)

Flat = torch.Tensor  # one MLP's parameters, flattened in name order


def flat_params(params: Dict[str, torch.Tensor]) -> Flat:
    return torch.cat([params[name].detach().double().flatten() for name in sorted(params)])


def layer_drift(reference: Dict[str, torch.Tensor], experts: Sequence[Dict[str, torch.Tensor]]) -> Dict:
    """drift and spread (module docstring) of one block's experts against its pre-trained MLP."""
    names = sorted(reference)
    for params in experts:
        if sorted(params) != names:
            raise ValueError(f"expert parameters {sorted(params)} do not match the pre-trained MLP's {names}")
    w0 = flat_params(reference)
    scale = float(w0.norm())
    w_EP = torch.stack([flat_params(p) for p in experts])
    drift_E = (w_EP - w0).norm(dim=1) / scale
    spread_E = (w_EP - w_EP.mean(dim=0)).norm(dim=1) / scale
    return {
        "experts": len(experts),
        "drift": float(drift_E.mean()),
        "drift_max": float(drift_E.max()),
        "spread": float(spread_E.mean()),
        "spread_max": float(spread_E.max()),
    }


def mlp_params(model: torch.nn.Module, blocks: Sequence[int], where: str) -> Dict[int, Dict[str, torch.Tensor]]:
    """Each block's dense MLP as expert parameters (w_in, b_in, w_out, ...), by the HF adapters."""
    try:
        sites = find_mlps(model)
    except ValueError as err:
        raise ValueError(f"{where}: drift needs an upcycled pre-trained model; {err}") from None
    for block in blocks:
        if not 0 <= block < len(sites):
            raise ValueError(f"{where}: block {block} is not one of the model's {len(sites)} MLP blocks")
    return {block: dict(sites[block].convert().named_parameters()) for block in blocks}


def dense_model(run: RunConfig, params: Optional[Dict[str, torch.Tensor]] = None) -> torch.nn.Module:
    """The run's model with no MoE layer: pre-trained weights, or ``params`` (a dense run's dense state)."""
    no_moe = dataclasses.replace(run, model=dataclasses.replace(run.model, moe_layers=[]))
    model = build_model(no_moe.model, no_moe.moe, build_task(no_moe.task).model_needs()).model
    if params is not None:
        unexpected = model.load_state_dict(params, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"dense parameters {unexpected[:3]} have no place in {type(model).__name__}")
    return model


def run_drift(run_dir: Path, blocks: Optional[Sequence[int]] = None, reference=None) -> Dict:
    """{"run", "step", "layers": {block: layer_drift}} for one run directory. ``blocks`` defaults to the
    run's MoE blocks (a dense run must be given them); ``reference`` (mlp_params of the pre-trained model)
    saves rebuilding it for runs of the same model."""
    checkpoint = last_complete_checkpoint(Path(run_dir))
    meta, run = read_checkpoint_meta(checkpoint)
    if run.lora.enabled:  # its checkpoints hold the adapters, not the weights drift compares
        raise ValueError(f"RUN_DIR ({str(run_dir)!r}) is a LoRA run (lora.enabled): its base's weights never move")
    moe_blocks = sorted(run.model.moe_layers)
    blocks = list(blocks) if blocks is not None else moe_blocks
    if not blocks:
        raise ValueError(f"RUN_DIR ({str(run_dir)!r}) is a dense run: --blocks must name the MLP blocks to compare")
    if moe_blocks and sorted(blocks) != moe_blocks:
        raise ValueError(f"--blocks ({blocks}) must be the run's MoE blocks ({moe_blocks}) for {str(run_dir)!r}")
    where = str(run_dir)
    reference = reference if reference is not None else mlp_params(dense_model(run), blocks, where)
    if moe_blocks:
        counts = saved_expert_counts(meta)
        experts = read_checkpoint_experts(checkpoint)
        trained = {
            block: [experts[f"{index}/{e}"]["params"] for e in range(counts[index])]
            for index, block in enumerate(moe_blocks)
        }
    else:
        dense = dense_model(run, read_checkpoint_dense(checkpoint))
        trained = {block: [p] for block, p in mlp_params(dense, blocks, where).items()}
    layers = {block: layer_drift(reference[block], trained[block]) for block in blocks}
    return {"run": where, "step": int(meta["step"]), "layers": layers}


def mean_over_layers(result: Dict, key: str) -> float:
    return statistics.fmean(layer[key] for layer in result["layers"].values())


def compare_table(out: Path) -> List[str]:
    """Markdown rows, one per model of a compare output directory: drift and spread (in % of the
    pre-trained MLP's norm, mean over the MoE blocks) as mean ± std over seeds, and the experts."""
    run_dirs = sorted(p for p in (out / "runs").glob("*/seed*") if complete_checkpoints(str(p)))
    if not run_dirs:
        raise ValueError(f"--compare ({str(out)!r}) holds no finished run with a checkpoint (runs/<model>/seed<s>)")
    # The MoE blocks of the first MoE run (every run of a comparison upcycles the same model).
    configs = (read_checkpoint_meta(last_complete_checkpoint(p))[1] for p in run_dirs)
    first_moe = next((run for run in configs if run.model.moe_layers), None)
    if first_moe is None:
        raise ValueError(f"--compare ({str(out)!r}) holds only dense runs: no MoE blocks to compare")
    blocks = sorted(first_moe.model.moe_layers)
    reference = mlp_params(dense_model(first_moe), blocks, str(out))
    by_model: Dict[str, List[Dict]] = {}
    for run_dir in run_dirs:
        by_model.setdefault(run_dir.parent.name, []).append(run_drift(run_dir, blocks, reference))
    rows = [
        "| model | seeds | drift from the pre-trained MLP (%) | spread between experts (%) | experts per block |",
        "|---|---|---|---|---|",
    ]
    for model, results in by_model.items():
        rows.append(
            f"| {model} | {len(results)} | {_pct(results, 'drift')} | {_spread(results)} | {_experts(results)} |"
        )
    return rows


def _pct(results: List[Dict], key: str) -> str:
    values = [100 * mean_over_layers(r, key) for r in results]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {std:.2f}"


def _spread(results: List[Dict]) -> str:
    return (
        "-"
        if all(layer["experts"] == 1 for r in results for layer in r["layers"].values())
        else _pct(results, "spread")
    )


def _experts(results: List[Dict]) -> str:
    per_block = zip(*[[layer["experts"] for layer in r["layers"].values()] for r in results])
    return " / ".join(f"{statistics.fmean(counts):.1f}" for counts in per_block)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m dynmoe_dist.experiments drift") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run directories (each with checkpoints/step_*)")
    parser.add_argument(
        "--blocks", default="", help="comma-separated MLP blocks of a dense run (default: the MoE blocks)"
    )
    parser.add_argument("--compare", default="", help="a compare output directory: one table row per model")
    args = parser.parse_args(argv)
    if bool(args.runs) == bool(args.compare):
        parser.error("give RUN_DIRs or --compare DIR (one of the two)")
    try:
        blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else None
    except ValueError:
        parser.error(f"--blocks ({args.blocks!r}) must be comma-separated integers")
    try:
        if args.compare:
            print("\n".join(compare_table(Path(args.compare))))
        for run_dir in args.runs:
            print(json.dumps(run_drift(Path(run_dir), blocks)))
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
