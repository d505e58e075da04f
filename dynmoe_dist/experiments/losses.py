"""Loss ablation and growth diagnostics for DynMoE: what each aux loss does to the router, and why layers grow.

    python -m dynmoe_dist.experiments losses --task vit-mnist [--seeds 0] [--checkpoints 5] [--out DIR]

For every DynMoE loss set of experiments/models.py (the four losses, the paper's two, each of the four
switched off), one training run per seed, on compare's task presets and budget. During each run:

- at a few checkpoint steps, every DynMoE loss term (also those switched off: what they *would* do) is
  differentiated alone with autograd.grad on each layer's router: the norm of its gradient on the
  thresholds G and on the gate vectors W, unweighted (the layer multiplies the sum by
  moe.aux_loss_weight); and the norm of the step's whole gradient there (task + weighted aux), for scale;
- at every step, per layer, the mean k and the share of tokens with k = 0;
- at every window end, per layer, the window's token count, how many of its tokens selected no expert
  (the add rule's trigger) and how many experts the plan added and removed.

Afterwards the event records of metrics.jsonl give every expert an identity across events, so an added
expert's later removal can be seen. Writes DIR/losses.json and DIR/losses.md (a section for
docs/results.md); runs live in DIR/runs/<model>/seed<s>/.

Shape legend: T tokens, E experts, D model dim. Runs on one process (the gradients need the layer's own
autograd graph; the window counts are then the global ones).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..moe import losses as aux
from ..moe.layer import find_moe_layers
from ..train.telemetry import METRICS_FILE, read_metrics
from .compare import TASK_EPOCHS, TASK_PRESETS, build_config, parse_seeds, steps_per_epoch
from .growth import growth_summary, track_experts
from .models import FOUR_LOSSES, LOSS_MODELS, MODELS
from .report_losses import losses_markdown

DIAGNOSTICS_FILE = "diagnostics.json"


def checkpoint_steps(total_steps: int, num_checkpoints: int) -> List[int]:
    """num_checkpoints step indices (0-based) spread evenly from the first step to the last."""
    if num_checkpoints < 1 or total_steps < 1:
        raise ValueError(f"--checkpoints ({num_checkpoints}) and the run's steps ({total_steps}) must be >= 1")
    if num_checkpoints == 1:
        return [total_steps - 1]
    return sorted({round(i * (total_steps - 1) / (num_checkpoints - 1)) for i in range(num_checkpoints)})


def loss_terms(layer, routing) -> Dict[str, torch.Tensor]:
    """Each DynMoE aux loss of this layer's routing, unweighted, whether or not the layer has it on."""
    token_names = [n for n in FOUR_LOSSES if n in aux.TOKEN_LOSSES]
    terms = dict(zip(token_names, aux.token_losses(token_names, routing)))
    terms["diverse"] = aux.diverse_loss(layer.router.weight)
    terms["simple"] = aux.simple_loss(layer.router.weight)
    return {name: terms[name] for name in FOUR_LOSSES}


def gradient_norms(layer, routing) -> List[Dict]:
    """Per loss: its value and the L2 norms of its gradient on the thresholds and on the gate vectors.
    retain_graph: the training step's own backward runs through the same routing afterwards."""
    params = [layer.router.threshold, layer.router.weight]
    rows = []
    for name, term in loss_terms(layer, routing).items():
        grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
        norms = [0.0 if g is None else float(g.norm()) for g in grads]  # NOTE: device-to-host sync (diagnostic)
        rows.append(
            {
                "loss": name,
                "on": name in layer.config.aux_losses,
                "value": float(term.detach()),
                "threshold_grad_norm": norms[0],
                "gate_grad_norm": norms[1],
            }
        )
    return rows


class LossProbe:
    """A routing observer for training forwards: k and the k = 0 share of every step, per-loss gradients
    at the checkpoint steps. Steps are counted in training forwards (one per step: grad_accum 1)."""

    def __init__(self, num_layers: int, checkpoints: Sequence[int]):
        self.checkpoints = set(checkpoints)
        self.calls = [0] * num_layers
        self.k_sum: List[List[torch.Tensor]] = [
            [] for _ in range(num_layers)
        ]  # per step: (sum of k, tokens, tokens with k = 0)
        self.gradients: List[Dict] = []

    @classmethod
    def attach(cls, model, checkpoints: Sequence[int]) -> "LossProbe":
        layers = [layer for _, layer in find_moe_layers(model)]
        probe = cls(len(layers), checkpoints)
        for index, layer in enumerate(layers):
            layer.routing_observers.append(_Observer(probe, index))
        return probe

    def observe(self, index: int, layer, routing) -> None:
        if not layer.training:
            return
        step = self.calls[index]
        self.calls[index] += 1
        selected_T = (routing.gates.detach() > 0).sum(dim=-1)
        self.k_sum[index].append(
            torch.stack(
                [selected_T.sum().double(), torch.tensor(float(selected_T.numel())), (selected_T == 0).sum().double()]
            )
        )
        if step in self.checkpoints:
            self.gradients += [{"step": step + 1, "layer": index, **row} for row in gradient_norms(layer, routing)]
            self.record_total(step + 1, index, layer)

    def record_total(self, step: int, index: int, layer) -> None:
        """The step's whole router gradient (task loss + the weighted aux losses that are on), caught by
        one-shot hooks on the router parameters as the training backward reaches them: the scale the
        per-loss norms are to be read against."""
        row = {"step": step, "layer": index, "loss": "total", "on": True, "value": float("nan")}
        self.gradients.append(row)
        for name, param in (("threshold_grad_norm", layer.router.threshold), ("gate_grad_norm", layer.router.weight)):
            handle: List = []

            def hook(grad, name=name, handle=handle):
                row[name] = row.get(name, 0.0) + float(grad.norm())  # NOTE: device-to-host sync (diagnostic)
                handle[0].remove()

            handle.append(param.register_hook(hook))

    def k_over_time(self) -> Dict[str, List[List[float]]]:
        """Per layer, per step: mean k and k = 0 share. NOTE: device-to-host sync (once, at the end)."""
        out: Dict[str, List[List[float]]] = {"mean_k": [], "k0_share": []}
        for steps in self.k_sum:
            table = torch.stack(steps).cpu() if steps else torch.zeros(0, 3)
            out["mean_k"].append((table[:, 0] / table[:, 1]).tolist())
            out["k0_share"].append((table[:, 2] / table[:, 1]).tolist())
        return out


class _Observer:
    def __init__(self, probe: LossProbe, index: int):
        self.probe, self.index = probe, index

    def __call__(self, layer, x_TD, routing) -> None:
        self.probe.observe(self.index, layer, routing)


class RecordingCoordinator:
    """Wraps the run's coordinator: per window end and layer, the statistics the add rule saw and what
    the plan did. Local statistics are the global ones on one process."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.windows: List[Dict] = []

    def submit(self, request, local_stats):
        plan = self.inner.submit(request, local_stats)
        for layer_plan, stats in zip(plan.layers, local_stats):
            tokens, unrouted = stats.num_tokens, stats.num_unrouted
            self.windows.append(
                {
                    "step": request.step,
                    "layer": layer_plan.layer,
                    "num_tokens": tokens,
                    "num_unrouted": unrouted,
                    "unrouted_share": unrouted / tokens if tokens else 0.0,
                    "num_experts_before": len(stats.counts_E),
                    "added": len(layer_plan.added),
                    "removed": len(layer_plan.removed),
                }
            )
        return plan

    def __getattr__(self, name):  # everything else (shutdown, ...) is the wrapped coordinator's
        return getattr(self.inner, name)


def diagnose_run(config, num_checkpoints: int) -> Dict:
    """One training run with the probes; returns its diagnostics (not yet the growth analysis)."""
    from ..coordination import CollectiveCoordinator
    from ..train.loop import Trainer
    from ..train.run import run

    trainer = Trainer(config)
    checkpoints = checkpoint_steps(trainer.schedule.total_steps, num_checkpoints)
    probe = LossProbe.attach(trainer.model, checkpoints)
    recorder: Dict[str, RecordingCoordinator] = {}

    def factory(groups):
        recorder["c"] = RecordingCoordinator(CollectiveCoordinator(groups))
        return recorder["c"]

    run(config, trainer=trainer, coordinator_factory=factory)
    windows = recorder["c"].windows if recorder else []
    return {
        "aux_losses": list(config.moe.aux_losses),
        "aux_loss_weight": config.moe.aux_loss_weight,
        "checkpoints": [s + 1 for s in checkpoints],
        "gradients": probe.gradients,
        **probe.k_over_time(),
        "windows": windows,
    }


def run_or_reuse(model: str, seed: int, config, num_checkpoints: int, reuse: bool, log=print) -> Dict:
    folder = Path(config.output.out_dir)
    saved = folder / DIAGNOSTICS_FILE
    key = {"config": config.to_toml(), "checkpoints": num_checkpoints}
    if reuse and saved.is_file() and json.loads(saved.read_text()).get("key") == key:
        log(f"{model} seed {seed}: reusing {saved}")
        result = json.loads(saved.read_text())
    else:
        shutil.rmtree(folder, ignore_errors=True)  # metrics.jsonl is appended to
        folder.mkdir(parents=True)
        started = time.perf_counter()
        result = {"model": model, "seed": seed, **diagnose_run(config, num_checkpoints), "key": key}
        saved.write_text(json.dumps(result))  # last: its key marks a finished run
        log(f"{model} seed {seed}: done in {time.perf_counter() - started:.0f}s")
    records = read_metrics(folder / METRICS_FILE)
    events = [r for r in records if r["kind"] == "event"]
    tracked = track_experts(events, [config.moe.num_experts] * len(config.model.moe_layers))
    final = next(r for r in reversed(records) if r["kind"] == "final")
    return {
        **result,
        "final_accuracy": 100.0 * final["test_accuracy"],
        "experts": tracked,
        "growth": growth_summary(result["windows"], tracked),
    }


def parse_loss_models(text: str) -> List[str]:
    names = LOSS_MODELS if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOSS_MODELS]
    if bad or not names:
        raise ValueError(f"--models ({text!r}): not a DynMoE loss model: {bad}; choose from {', '.join(LOSS_MODELS)}")
    return list(names)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m dynmoe_dist.experiments losses") -> Dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="vit-mnist", help=f"one of {', '.join(TASK_PRESETS)} (default vit-mnist)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default: compare's per task)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--models", default="all", help="comma-separated subset of " + ", ".join(LOSS_MODELS))
    parser.add_argument("--checkpoints", type=int, default=5, help="steps with per-loss gradients (default 5)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a run option (repeatable)",
    )
    parser.add_argument("--out", default="runs/losses", help="output directory (default runs/losses)")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false", help="re-run finished runs")
    args = parser.parse_args(argv)
    try:
        models, seeds = parse_loss_models(args.models), parse_seeds(args.seeds)
        epochs = TASK_EPOCHS.get(args.task, 10) if args.epochs is None else args.epochs
        configs = {
            (m, s): build_config(args.task, MODELS[m], s, epochs, Path(args.out), args.overrides)
            for s in seeds
            for m in models
        }
        first = next(iter(configs.values()))
        every = steps_per_epoch(first)
        configs = {
            k: build_config(args.task, MODELS[k[0]], k[1], epochs, Path(args.out), args.overrides, eval_every=every)
            for k in configs
        }
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(1)
    results = [run_or_reuse(m, s, configs[(m, s)], args.checkpoints, args.reuse) for (m, s) in configs]
    out = Path(args.out)
    (out / "losses.json").write_text(
        json.dumps({"task": args.task, "epochs": epochs, "steps_per_epoch": every, "runs": results}, indent=1)
    )
    markdown = losses_markdown(results, args.task, epochs, every, f"{prog} {' '.join(argv)}".strip())
    (out / "losses.md").write_text(markdown)
    print(markdown)
    return {"runs": results, "markdown": markdown}
