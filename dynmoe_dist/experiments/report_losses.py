"""The markdown section of `python -m dynmoe_dist.experiments losses`: per-loss router gradients, k and
the k = 0 share per epoch, and the growth analysis. Pure: built from the runs' diagnostics dicts."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence

import numpy as np

from .models import FOUR_LOSSES, MODELS


def _by_model(runs: Sequence[Dict]) -> Dict[str, List[Dict]]:
    grouped: Dict[str, List[Dict]] = defaultdict(list)
    for run in runs:
        grouped[run["model"]].append(run)
    return grouped


def _mean_of(rows: Sequence[Dict], key: str) -> float:
    # A hook that never fired (the parameter got no gradient that step) leaves the key out: 0.
    return float(np.mean([g.get(key, 0.0) for g in rows]))


def _loss_name(loss: str, on: Sequence[str]) -> str:
    if loss == "total":
        return "**whole step** (task + aux)"
    return loss if loss in on else f"{loss} (off)"


def gradient_table(runs: Sequence[Dict]) -> str:
    """| model | loss | at step s1 | s2 | ... |: 'dG / dW' gradient norms, mean over seeds and layers."""
    steps = sorted({g["step"] for run in runs for g in run["gradients"]})
    lines = ["| model | loss | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|---|" + "---|" * len(steps)]
    for model, mine in _by_model(runs).items():
        for loss in (*FOUR_LOSSES, "total"):
            cells = []
            for step in steps:
                rows = [g for run in mine for g in run["gradients"] if g["loss"] == loss and g["step"] == step]
                cells.append(
                    f"{_mean_of(rows, 'threshold_grad_norm'):.2e} / {_mean_of(rows, 'gate_grad_norm'):.2e}"
                    if rows
                    else "-"
                )
            lines.append(
                f"| {MODELS[model].label} | {_loss_name(loss, mine[0]['aux_losses'])} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def per_epoch(values_per_step: Sequence[float], steps_per_epoch: int) -> List[float]:
    """Mean of each whole epoch's steps."""
    values = np.asarray(values_per_step, dtype=np.float64)
    num = len(values) // steps_per_epoch
    return [float(values[e * steps_per_epoch : (e + 1) * steps_per_epoch].mean()) for e in range(num)]


def k_table(runs: Sequence[Dict], steps_per_epoch: int) -> str:
    """| model | epoch 1 | ... | final acc |: 'mean k / k=0 %' per epoch, mean over layers and seeds, and the
    final test accuracy (%, mean over seeds)."""
    rows, num_epochs = [], 0
    for model, mine in _by_model(runs).items():
        k = np.mean([per_epoch(layer, steps_per_epoch) for run in mine for layer in run["mean_k"]], axis=0)
        k0 = np.mean([per_epoch(layer, steps_per_epoch) for run in mine for layer in run["k0_share"]], axis=0)
        num_epochs = max(num_epochs, len(k))
        cells = [f"{a:.2f} / {100 * b:.0f}%" for a, b in zip(k, k0)]
        cells.append(f"{np.mean([run['final_accuracy'] for run in mine]):.2f}")
        rows.append(f"| {MODELS[model].label} | " + " | ".join(cells) + " |")
    header = [
        "| model | " + " | ".join(f"epoch {e}" for e in range(1, num_epochs + 1)) + " | final acc (%) |",
        "|---|" + "---|" * (num_epochs + 1),
    ]
    return "\n".join(header + rows)


def _range(values: Sequence[float], spec: str) -> str:
    if not values:
        return "-"
    return f"{format(float(np.median(values)), spec)} [{format(min(values), spec)}, {format(max(values), spec)}]"


def growth_table(runs: Sequence[Dict]) -> str:
    """| model | layer | windows | with k=0 tokens | with an add | unrouted tokens at an add | their share |
    added | added, later removed | initial removed | experts at the end |; counts summed over seeds."""
    lines = [
        "| model | layer | windows | with k=0 tokens | with an add | k=0 tokens behind an add: median "
        "[min, max] | their share of the window (%) | added | added, later removed | initial experts "
        "removed | experts at the end (per seed) |",
        "|---|" + "---|" * 10,
    ]
    for model, mine in _by_model(runs).items():
        for index in range(len(mine[0]["growth"])):
            g = [run["growth"][index] for run in mine]

            def total(key: str, g=g) -> float:
                return sum(x[key] for x in g)

            counts = [c for x in g for c in x["trigger_unrouted"]]
            shares = [100 * s for x in g for s in x["trigger_share"]]
            lines.append(
                f"| {MODELS[model].label} | {index} | {total('num_windows')} | "
                f"{total('windows_with_unrouted')} | {total('windows_with_add')} | {_range(counts, '.0f')} | "
                f"{_range(shares, '.2f')} | {total('num_added')} | {total('added_later_removed')} | "
                f"{total('initial_removed')} | {', '.join(str(x['final_experts']) for x in g)} |"
            )
    return "\n".join(lines)


def losses_markdown(runs: Sequence[Dict], task: str, epochs: int, steps_per_epoch: int, command: str) -> str:
    seeds = sorted({run["seed"] for run in runs})
    weight = runs[0]["aux_loss_weight"] if runs else 0.01
    return "\n".join(
        [
            f"## Loss ablation and growth diagnostics ({task}, {epochs} epochs x {steps_per_epoch} steps, "
            f"seeds {', '.join(map(str, seeds))})",
            "",
            f"    {command}",
            "",
            "Gradient norm of each aux loss alone on the router, `‖∂L/∂G‖ / ‖∂L/∂W‖` (thresholds G, gate vectors "
            f"W), unweighted (the layer adds their sum x {weight:g}); mean over MoE layers and seeds. '(off)': the "
            "model trains without that loss; the number is what it would contribute. 'whole step': the norm of the "
            "step's full gradient there (task loss + the weighted aux losses that are on), for scale.",
            "",
            gradient_table(runs),
            "",
            "Mean k / share of tokens with k = 0, per epoch (training steps; mean over MoE layers and seeds), and "
            "the final test accuracy:",
            "",
            k_table(runs, steps_per_epoch),
            "",
            "Growth: at every window end the reference adds an expert if any token of the window selected none "
            "(`adaptive.min_unrouted_share = 0`). Per layer, counts summed over seeds; 'k=0 tokens behind an add' "
            "are the window's unrouted tokens when an add fired. 'added, later removed': added experts that a "
            "later event removed (identities replayed from the event records of metrics.jsonl).",
            "",
            growth_table(runs),
            "",
        ]
    )
