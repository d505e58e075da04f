"""`python -m dynmoe_dist.experiments moe-finetune --model DIR [--seeds 3] [--out OUT] [--tiny]`: does
converting a pre-trained MoE to DynMoE's top-any routing pay on a new domain?

The pre-trained checkpoint (`pretrain-moe`: a small Qwen3-MoE, top-2 of 16 experts, trained on Python
docstrings) is finetuned on the Rotten Tomatoes snippets (task 'causal-lm', task.path 'rotten-tomatoes',
20 % of the snippets held out) three ways, per seed, with the same steps, batch, lr and data order:
  native          the model's own top-2 routing (moe.router 'native'); adaptive events only re-place experts
  top-any         routers converted to top-any (thresholds calibrated to the model's own k); no events
  top-any-pruned  the same with adaptive events that only remove: experts no token routes to in a window
                  are removed ("domain pruning"; adaptive.max_adds_per_event = 0)
  top-any-adaptive  the same with DynMoE's full events: removals, and experts added for tokens that
                  found none
Before any step, every seed's held-out loss is measured for native and for top-any with both combine
rules ('equal' 1/k, DynMoE's; 'softmax' the router's probabilities renormalised over the chosen experts);
the top-any finetunes use the rule with the lower mean. After training: held-out loss, k, experts per
layer, expert FLOPs per token against native (moe_report.py), and each run's export
(`python -m dynmoe_dist.export`) timed per generated token (`python -m dynmoe_dist.bench generate`,
against the pre-trained model). Writes OUT/results.json and OUT/results.md; a finished run (its
config.toml written last) is reused, and a failed export or timing is retried, on the next call.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..bench.commands import CommandFailed, export_checkpoint
from ..config import RunConfig, load_config
from ..train.checkpoint import last_complete_checkpoint
from ..train.cli import exit_usage_error
from ..train.telemetry import METRICS_FILE, read_metrics
from .moe_report import FinetuneResult, aggregate_variant, summarise_finetune
from .moe_runs import generation_ms, log, simulated
from .probe import RoutingProbe, add_totals

CONFIG_FILE = "config.toml"
RESULT_FILE = "result.json"
COMBINES = ("equal", "softmax")
# name -> (label, moe.router, adaptive.enabled, further overrides)
VARIANTS = {
    "native": ("native top-k", "native", True, ()),
    "top-any": ("top-any (converted)", "top_any", False, ()),
    "top-any-pruned": ("top-any + pruning", "top_any", True, ("adaptive.max_adds_per_event=0",)),
    "top-any-adaptive": ("top-any + pruning and adds", "top_any", True, ()),
}


@dataclass(frozen=True)
class Sizes:
    max_len: int
    batch: int
    epochs: float
    lr: float
    warmup_steps: int
    num_samples: int
    """task.num_samples: 0 = every snippet."""
    world_size: int
    bench_threads: int
    bench_repeats: int


# 2 epochs: two adaptive windows (1/3 to 2/3 of each epoch) for the pruned variant. Batch 16 x 128 tokens
# as in pre-training; lr a quarter of pre-training's peak (a finetune, not a new start). The 4866 snippets
# are about 184k tokens under an 8k BPE of docstrings (measured), so about 70 steps per epoch, 140 per run,
# each window about 24 steps (50k tokens routed per layer).
FULL = Sizes(
    max_len=128,
    batch=16,
    epochs=2,
    lr=5e-4,
    warmup_steps=10,
    num_samples=0,
    world_size=2,
    bench_threads=2,
    bench_repeats=5,
)
TINY = replace(FULL, max_len=16, batch=8, lr=1e-3, warmup_steps=1, num_samples=40, bench_threads=1, bench_repeats=1)


@dataclass(frozen=True)
class Plan:
    """What one call runs, checked before the first (long) run starts."""

    model: Path
    out: Path
    seeds: List[int]
    sizes: Sizes
    model_info: Dict[str, Any]
    """--model's type, experts per layer and top-k (check_model)."""

    def config(
        self, router: str, adaptive: bool, seed: int, out_dir: Path, combine: str = "equal", extra: Sequence[str] = ()
    ) -> RunConfig:
        s = self.sizes
        overrides = [
            "task.name='causal-lm'",
            "task.path='rotten-tomatoes'",
            f"task.max_len={s.max_len}",
            f"task.num_samples={s.num_samples}",
            f"task.cache_dir='{(self.out / 'tokens').as_posix()}'",
            "task.prepare_workers=1",  # 5000 snippets: a worker pool costs more than it saves
            "model.source='hf'",
            f"model.path='{self.model.as_posix()}'",
            f"moe.router='{router}'",
            f"train.epochs={s.epochs}",
            f"train.global_batch_size={s.batch}",
            f"train.lr={s.lr}",
            f"train.warmup_steps={s.warmup_steps}",
            f"train.seed={seed}",
            f"adaptive.enabled={str(adaptive).lower()}",
            f"parallel.ep_size={s.world_size}",
            f"output.out_dir='{out_dir.as_posix()}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
            "output.keep_checkpoints=1",
        ]
        if router == "top_any":
            overrides.append(f"moe.combine='{combine}'")
        return load_config(None, overrides + list(extra))

    def variant_config(self, variant: str, seed: int, combine: str) -> RunConfig:
        _, router, adaptive, extra = VARIANTS[variant]
        return self.config(router, adaptive, seed, self.run_dir(variant, seed), combine, extra)

    def step0_configs(self, seed: int) -> Dict[str, RunConfig]:
        """native, top-any-equal, top-any-softmax: evaluated before any step (nothing is written)."""
        where = self.out / "step0"
        configs = {"native": self.config("native", False, seed, where)}
        for combine in COMBINES:
            configs[f"top-any-{combine}"] = self.config("top_any", False, seed, where, combine)
        return configs

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / "runs" / variant / f"seed{seed}"


def check_model(path: str) -> Dict[str, Any]:
    """--model must be a transformers MoE checkpoint with its tokenizer: one-line ValueErrors otherwise."""
    from ..models.source import require_moe

    info = require_moe(path, "--model")
    if not (Path(path) / "tokenizer_config.json").is_file():
        raise ValueError(f"--model ({path!r}) holds no tokenizer (tokenizer_config.json)")
    return info


# ----------------------------------------------------------------------------------------------------
# Jobs on the simulated ranks


def _layer_shape(trainer) -> Dict[str, int]:
    """D, F and matmuls per expert (gated: 3) of the first MoE layer: every sparse block has the same."""
    config = trainer.moe_layers[0].config
    return {"dim": config.dim, "ffn_dim": config.ffn_dim, "matmuls": 2 if config.expert_kind == "ffn" else 3}


def _step0_on_rank(configs: Dict[str, RunConfig]) -> Dict[str, Any]:
    from ..train.loop import Trainer
    from ..train.run import start

    out: Dict[str, Any] = {}
    for name, config in configs.items():
        trainer = Trainer(config)
        probe = RoutingProbe.attach(trainer.model)
        # run()'s own start: a top-any conversion is calibrated, then evaluated once
        calibration = start(config, trainer).calibration
        loss = calibration["test_loss_after_conversion"] if calibration else trainer.evaluate()["test_loss"]
        out[name] = {"test_loss": loss, "probe": probe.totals(), **_layer_shape(trainer)}
    return out


def _finetune_on_rank(config: RunConfig) -> Dict[str, Any]:
    """{'probe': the routing probe's totals, 'peak_mib': this rank's peak resident memory above what it held
    before the model was built (NaN where it cannot be measured)}."""
    from ..bench.measure import measured_call
    from ..train.loop import Trainer
    from ..train.run import run

    out: Dict[str, Any] = {}

    def finetune() -> None:
        trainer = Trainer(config)
        probe = RoutingProbe.attach(trainer.model)
        run(config, trainer=trainer)
        out["probe"] = probe.totals()

    out["peak_mib"] = measured_call(finetune)[0]
    return out


def eval_k(probe: Dict[str, List[float]]) -> List[float]:
    """Per layer, experts per token at the evaluation the probe saw last (fallback included)."""
    return [k / t if t else float("nan") for k, t in zip(probe["eval_k_sum"], probe["eval_tokens"])]


def step0(plan: Plan, seed: int, reuse: bool) -> Dict[str, Any]:
    """{name: {test_loss, eval_k, dim, ffn_dim, matmuls}} of the three step-0 models of one seed."""
    configs = plan.step0_configs(seed)
    file = plan.out / "step0" / f"seed{seed}.json"
    key = {name: c.to_toml() for name, c in configs.items()}
    if reuse and file.is_file() and json.loads(file.read_text())["configs"] == key:
        return json.loads(file.read_text())["models"]
    per_rank = simulated(_step0_on_rank, plan.sizes.world_size, (configs,))
    models = {}
    for name in configs:
        probe = add_totals([rank[name]["probe"] for rank in per_rank])
        models[name] = {**{k: v for k, v in per_rank[0][name].items() if k != "probe"}, "eval_k": eval_k(probe)}
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"configs": key, "models": models}, indent=1))
    return models


def choose_combine(step0_by_seed: Dict[int, Dict[str, Any]]) -> str:
    """The combine rule with the lower mean step-0 held-out loss over the seeds ('equal' on a tie)."""
    means = {c: sum(s[f"top-any-{c}"]["test_loss"] for s in step0_by_seed.values()) for c in COMBINES}
    return min(COMBINES, key=lambda c: means[c])


# ----------------------------------------------------------------------------------------------------
# The finetunes


def finished(config: RunConfig) -> bool:
    """The run directory holds a finished run of exactly this config (config.toml is written last). The saved
    file is compared as this code reads it, so a run finished before an option was added (and so is missing
    its line, at its default) is still found."""
    folder = Path(config.output.out_dir)
    saved = folder / CONFIG_FILE
    if not (saved.is_file() and (folder / RESULT_FILE).is_file()):
        return False
    if saved.read_text() == config.to_toml():
        return True
    try:
        return load_config(str(saved)) == config
    except ValueError:  # an option this code no longer has, or a value it refuses: not this config
        return False


def finish(plan: Plan, result: FinetuneResult, folder: Path) -> FinetuneResult:
    """Export the final checkpoint and time its generation; a failure is recorded (and retried by the next
    call), not raised: the training it follows took far longer and its numbers stand."""
    export = folder / "export"
    shutil.rmtree(export, ignore_errors=True)
    try:
        export_checkpoint(last_complete_checkpoint(folder), export)
    except (CommandFailed, ValueError) as err:
        log(f"  export failed: {err}")
        return replace(result, export="", export_error=str(err), generate_error="no export")
    result = replace(result, export=str(export), export_error="")
    try:
        s = plan.sizes
        times = generation_ms(export, plan.model, s.bench_threads, s.bench_repeats, folder / "hf_modules")
    except CommandFailed as err:
        log(f"  generation timing failed: {err}")
        return replace(result, generate_error=str(err))
    return replace(
        result, generate_error="", per_token_ms=times["per_token_ms"], base_per_token_ms=times["base_per_token_ms"]
    )


def needs_finish(result: FinetuneResult) -> bool:
    return not result.export or bool(result.export_error or result.generate_error)


def train_run(plan: Plan, variant: str, seed: int, combine: str, step0_loss: float, reuse: bool) -> FinetuneResult:
    config = plan.variant_config(variant, seed, combine)
    return train_config(plan, variant, config, seed, step0_loss, reuse, export=True)


def train_config(
    plan: Plan, name: str, config: RunConfig, seed: int, step0_loss: float, reuse: bool, export: bool
) -> FinetuneResult:
    """One finetune of ``config`` (reused when its folder holds this config finished), then, with ``export``,
    its export and generation timing (retried when an earlier call's failed)."""
    folder = Path(config.output.out_dir)
    if reuse and finished(config):
        log(f"{name} seed {seed}: reusing the finished run in {folder}")
        result = FinetuneResult(**json.loads((folder / RESULT_FILE).read_text()))
    else:
        shutil.rmtree(folder, ignore_errors=True)  # metrics.jsonl is appended to: start clean
        folder.mkdir(parents=True)
        started = time.perf_counter()
        per_rank = simulated(_finetune_on_rank, plan.sizes.world_size, (config,))
        probe = add_totals([rank["probe"] for rank in per_rank])
        result = summarise_finetune(name, seed, read_metrics(folder / METRICS_FILE), eval_k(probe), step0_loss)
        result = replace(result, peak_mib=max(rank["peak_mib"] for rank in per_rank))
        log(f"{name} seed {seed}: held-out loss {result.test_loss:.4f} in {time.perf_counter() - started:.0f}s")
    if export and needs_finish(result):
        result = finish(plan, result, folder)
    (folder / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
    (folder / CONFIG_FILE).write_text(config.to_toml())  # last: marks the run finished
    return result


def run_plan(plan: Plan, reuse: bool) -> Dict[str, Any]:
    """Step-0 evaluations of every seed, the combine choice, then every (seed, variant) finetune (seeds
    outermost, so an interrupted call has whole seeds done)."""
    step0_by_seed = {seed: step0(plan, seed, reuse) for seed in plan.seeds}
    combine = choose_combine(step0_by_seed)
    log(f"combine rule for top-any: {combine!r} (lower mean held-out loss at step 0)")
    results: Dict[str, List[FinetuneResult]] = {v: [] for v in VARIANTS}
    for seed in plan.seeds:
        for variant in VARIANTS:
            start_model = "native" if variant == "native" else f"top-any-{combine}"
            loss0 = step0_by_seed[seed][start_model]["test_loss"]
            results[variant].append(train_run(plan, variant, seed, combine, loss0, reuse))
    shape = step0_by_seed[plan.seeds[0]]["native"]
    dims = (shape["dim"], shape["ffn_dim"], plan.model_info["top_k"], shape["matmuls"])
    rows = [aggregate_variant(v, VARIANTS[v][0], results[v], *dims) for v in VARIANTS]
    return {"step0": step0_by_seed, "combine": combine, "rows": rows, "shape": shape}


# ----------------------------------------------------------------------------------------------------
# CLI


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the pre-trained MoE checkpoint (pretrain-moe's DIR)")
    p.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 (default 3)")
    p.add_argument("--out", default="runs/moe_finetune", help="output directory (default runs/moe_finetune)")
    p.add_argument("--tiny", action="store_true", help="40 snippets, 16-token windows: seconds per run (tests)")
    p.add_argument("--world-size", type=int, default=0, help="simulated ranks per run (default 2; 1 = in this process)")
    p.add_argument("--no-reuse", dest="reuse", action="store_false", help="re-run finished runs too")
    return p


def make_plan(args) -> Plan:
    if args.seeds < 1:
        raise ValueError(f"--seeds ({args.seeds}) must be >= 1")
    if args.world_size < 0:
        raise ValueError(f"--world-size ({args.world_size}) must be >= 1 (0 = the default, 2)")
    info = check_model(args.model)
    sizes = TINY if args.tiny else FULL
    sizes = replace(sizes, world_size=args.world_size or sizes.world_size)
    plan = Plan(Path(args.model), Path(args.out), list(range(args.seeds)), sizes, info)
    for seed in plan.seeds:  # every config must load before the first run starts
        plan.step0_configs(seed)
        for variant in VARIANTS:
            plan.variant_config(variant, seed, "equal")
    return plan


def main(argv: Optional[Sequence[str]] = None, prog: str = "moe-finetune") -> Dict[str, Any]:
    from .moe_markdown import write_outputs

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    try:
        plan = make_plan(args)
    except ValueError as err:
        exit_usage_error(prog, err)
    started = time.perf_counter()
    outcome = run_plan(plan, args.reuse)
    command = f"python -m dynmoe_dist.experiments {prog.split()[-1]} {shlex.join(argv)}".strip()
    paths = write_outputs(plan, outcome, command, time.perf_counter() - started)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [f"{r.variant} seed {r.seed}" for row in outcome["rows"] for r in row.runs if needs_finish(r)]
    if failed:
        # The numbers above stand; the next call reuses the training and retries only these.
        print(f"{prog}: export or generation timing failed for {', '.join(failed)} (see results.json)", file=sys.stderr)
        raise SystemExit(1)
    return {"plan": plan, **outcome, "paths": paths}
