"""`python -m dynmoe_dist.experiments pretrain-moe [--out DIR] [--minutes M] [--steps N] [--tiny]`: a small
Qwen3-MoE pre-trained from scratch on the machine's own text, saved as a stock transformers checkpoint.

No small pre-trained MoE ships offline, and `moe-finetune` needs one to convert. The steps:
1. corpus: the docstrings of the running interpreter's standard library and site-packages
   (experiments/docstrings.py), capped, written to DIR/pretrain/corpus.jsonl;
2. tokenizer: byte-level BPE trained on it (data/bpe.py), EOS <|endoftext|>;
3. model: transformers' Qwen3MoeConfig at the FULL sizes below (16 experts, top-2, norm_topk_prob, the family's own
   load-balance loss on at a small coefficient so the experts stay balanced while they specialise),
   random init, save_pretrained to DIR/pretrain/init;
4. training with this project's trainer: native routing, expert parallel over 2 simulated gloo ranks
   (parallel.simulate.run_simulated), for --minutes of training-loop time: a timing probe of a few steps
   gives the seconds per step and so the step count (--steps N pins it instead, for a reproducible run);
5. `python -m dynmoe_dist.export` of the final checkpoint, a stock checkpoint (config.json,
   model.safetensors, tokenizer) copied into DIR, which plain ``from_pretrained`` loads.
Prints one JSON line (corpus size, tokens, steps, wall time, held-out loss, DIR), also written to
DIR/pretrain.json. A second call with the same settings finds DIR/pretrain.json and reuses the model; one
after a failed export finds DIR/pretrain/trained.json and only exports. --tiny: a slice of the standard
library, a 2-block model of 8 experts, 4 steps (the tests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..bench.commands import CommandFailed, export_checkpoint
from ..config import RunConfig, load_config
from ..data.bpe import padded_vocab, save_tokenizer, train_bpe
from ..train.checkpoint import last_complete_checkpoint
from ..train.cli import exit_usage_error
from .docstrings import build_corpus, default_roots, read_corpus
from .moe_runs import log, simulated

SUMMARY_FILE = "pretrain.json"
TRAINED_FILE = "trained.json"
WORK = "pretrain"


@dataclass(frozen=True)
class Sizes:
    """Everything that sets the pre-trained model and its training, except the step count."""

    corpus_mb: float
    vocab_size: int
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    expert_ffn: int
    num_experts: int
    top_k: int
    router_aux_loss_coef: float
    max_len: int
    batch: int
    lr: float
    warmup_steps: int
    test_fraction: float
    world_size: int
    probe_steps: int
    stdlib_parts: Tuple[str, ...] = ()
    """Read only these folders of the standard library (the tiny run: listing every installed file alone
    takes seconds); () = the whole standard library and site-packages."""
    prepare_workers: int = 0
    """task.prepare_workers: 0 = one per core for the full corpus; the tiny one is not worth a pool."""


# Measured on the 2-core machine (loaded, so a quiet one does better): 1.5 s per step of 16 x 128 tokens on
# 2 ranks, and 3.9 bytes of docstring per token. 12 minutes are then 500-1000 steps, 1-2M tokens; 12 MB of
# docstrings are about 3M tokens, so no document is seen twice. 2 % held out: about 60k tokens, a 15 s
# evaluation. The model: 4 blocks of hidden 256 (4 heads of 64, 2 key/value heads), 16 gated experts of
# 256 per block, top-2 as Qwen routes (norm_topk_prob), untied embeddings: 17.6M parameters, of which a
# token uses 2.4M in its blocks (1.6M in the 2 experts it is sent to in each) and 2.1M in the LM head. Batch
# 16 x 128 tokens: more optimizer steps in the budget than a larger batch would give.
FULL = Sizes(
    corpus_mb=12.0,
    vocab_size=8192,
    num_layers=4,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    expert_ffn=256,
    num_experts=16,
    top_k=2,
    router_aux_loss_coef=0.01,
    max_len=128,
    batch=16,
    lr=2e-3,
    warmup_steps=30,
    test_fraction=0.02,
    world_size=2,
    probe_steps=6,
)
TINY = replace(
    FULL,
    corpus_mb=0.06,
    vocab_size=512,
    num_layers=2,
    hidden=32,
    num_heads=2,
    num_kv_heads=1,
    expert_ffn=16,
    num_experts=8,
    max_len=32,
    batch=8,
    warmup_steps=2,
    test_fraction=0.1,
    probe_steps=2,
    stdlib_parts=("email", "json", "logging"),
    prepare_workers=1,
)
TINY_STEPS = 4


def qwen3_moe_config(sizes: Sizes, vocab: int, eos_id: int):
    """transformers' Qwen3MoeConfig at these sizes; every block sparse (mlp_only_layers empty)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=padded_vocab(vocab),
        hidden_size=sizes.hidden,
        intermediate_size=2 * sizes.hidden,  # a dense block's width; no block is dense here
        moe_intermediate_size=sizes.expert_ffn,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        num_experts=sizes.num_experts,
        num_experts_per_tok=sizes.top_k,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=sizes.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4 * sizes.max_len,
        tie_word_embeddings=False,  # as Qwen3-MoE ships; main's imported-weights reader wants lm_head.weight
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
    )


def write_init(sizes: Sizes, corpus: Path, directory: Path, seed: int) -> Dict[str, int]:
    """The tokenizer trained on the corpus and the randomly initialised model, both in ``directory``."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    tokenizer = train_bpe(read_corpus(corpus), sizes.vocab_size)
    save_tokenizer(tokenizer, directory)
    config = qwen3_moe_config(sizes, len(tokenizer), int(tokenizer.eos_token_id))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(str(directory))
    return {"vocab": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())}


def run_config(sizes: Sizes, work: Path, steps: int, out_dir: Path, seed: int) -> RunConfig:
    """The pre-training run: native routing (load_config fills it in from the checkpoint), expert parallel
    over the simulated ranks, no adaptive events (nothing to re-place for a model that is still forming),
    one final evaluation and checkpoint."""
    return load_config(
        None,
        [
            "task.name='causal-lm'",
            f"task.path='{(work / 'corpus.jsonl').as_posix()}'",
            f"task.max_len={sizes.max_len}",
            f"task.test_fraction={sizes.test_fraction}",
            f"task.cache_dir='{(work / 'tokens').as_posix()}'",
            f"task.prepare_workers={sizes.prepare_workers}",
            "model.source='hf'",
            f"model.path='{(work / 'init').as_posix()}'",
            "train.epochs=1000",  # max_steps binds
            f"train.max_steps={steps}",
            f"train.global_batch_size={sizes.batch}",
            f"train.lr={sizes.lr}",
            f"train.warmup_steps={min(sizes.warmup_steps, max(steps // 4, 1))}",
            f"train.seed={seed}",
            "train.log_every=10",
            "adaptive.enabled=false",
            f"parallel.ep_size={sizes.world_size}",
            f"output.out_dir='{out_dir.as_posix()}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
            "output.keep_checkpoints=1",
        ],
    )


def _probe_on_rank(config: RunConfig, steps: int) -> List[float]:
    from ..train.loop import Trainer

    trainer = Trainer(config)
    return [float(trainer.train_step()["step_s"]) for _ in range(steps)]


def seconds_per_step(config: RunConfig, steps: int, world_size: int) -> float:
    """The median step time of a short run of the same config, its first step (allocations, lazy
    imports) left out; the slowest rank's, since the ranks wait for one another at every step."""
    per_rank = simulated(_probe_on_rank, world_size, (config, steps + 1))
    return max(statistics.median(times[1:]) for times in per_rank)


def _train_on_rank(config: RunConfig) -> Dict[str, Any]:
    from ..train.loop import Trainer
    from ..train.run import run

    trainer = Trainer(config)
    final = run(config, trainer=trainer)
    return {**final, "train_windows": trainer.task.size("train"), "test_windows": trainer.task.size("test")}


def steps_for(minutes: float, step_s: float) -> int:
    if minutes <= 0:
        raise ValueError(f"--minutes ({minutes}) must be > 0")
    return max(1, int(minutes * 60 / step_s))


def settings(args, sizes: Sizes) -> Dict[str, Any]:
    """What decides the model, as it reads back from JSON (tuples become lists) so a saved copy compares equal."""
    wanted = {"sizes": asdict(sizes), "minutes": args.minutes, "steps": args.steps, "seed": args.seed}
    return json.loads(json.dumps(wanted))


def reusable(out: Path, wanted: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The summary of an earlier call with the same settings whose model is still there. A model of other
    settings in DIR is refused: copying over it would mix two models' files."""
    file = out / SUMMARY_FILE
    if not (out / "config.json").is_file():
        return None
    summary = json.loads(file.read_text()) if file.is_file() else {}
    if summary.get("settings") != wanted:
        raise ValueError(
            f"--out ({str(out)!r}) holds a model pre-trained with other settings (or none recorded in "
            f"{SUMMARY_FILE}); choose another --out or delete it"
        )
    return summary


def copy_model(export: Path, out: Path) -> None:
    """The export's files (config, weights, tokenizer) into DIR, next to DIR/pretrain/."""
    for path in export.iterdir():
        if path.is_file():
            shutil.copy2(path, out / path.name)


def train(args, sizes: Sizes, work: Path, wanted: Dict[str, Any]) -> Dict[str, Any]:
    """Corpus, tokenizer, initial model, timing probe and training: what DIR/pretrain/trained.json records.
    A call whose export failed left that file, and the next call with the same settings starts at the
    export instead of training again."""
    done = work / TRAINED_FILE
    if done.is_file() and json.loads(done.read_text())["settings"] == wanted:
        log(f"pretrain-moe: reusing the trained run in {work / 'run'}")
        return json.loads(done.read_text())
    started = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    roots = [default_roots()[0] / part for part in sizes.stdlib_parts] or None
    corpus = build_corpus(work / "corpus.jsonl", int(sizes.corpus_mb * 1e6), roots)
    log(f"pretrain-moe: corpus of {corpus.num_docs} docstrings, {corpus.num_bytes / 1e6:.2f} MB")
    model = write_init(sizes, work / "corpus.jsonl", work / "init", args.seed)
    step_s = None
    steps = args.steps or (TINY_STEPS if args.tiny else 0)
    if not steps:
        probe = run_config(sizes, work, 1000, work / "probe", args.seed)
        step_s = seconds_per_step(probe, sizes.probe_steps, sizes.world_size)
        steps = steps_for(args.minutes, step_s)
        log(f"pretrain-moe: {step_s:.2f} s per step -> {steps} steps in {args.minutes:g} min")
    config = run_config(sizes, work, steps, work / "run", args.seed)
    log(f"pretrain-moe: training {steps} steps on {sizes.world_size} simulated ranks")
    final = simulated(_train_on_rank, sizes.world_size, (config,))[0]
    trained = {
        "corpus_mb": round(corpus.num_bytes / 1e6, 3),
        "corpus": corpus.to_dict(),
        "tokens": (final["train_windows"] + final["test_windows"]) * (sizes.max_len + 1),
        "tokens_trained": steps * sizes.batch * sizes.max_len,
        "steps": steps,
        "probe_s_per_step": step_s,
        "train_wall_s": final["wall_s"],
        "wall_s": time.perf_counter() - started,
        "test_loss": final["test_loss"],
        **model,
        "settings": wanted,
    }
    done.write_text(json.dumps(trained, indent=1))
    return trained


def pretrain(args) -> Dict[str, Any]:
    sizes = TINY if args.tiny else FULL
    out, wanted = Path(args.out), settings(args, sizes)
    found = reusable(out, wanted)
    if found is not None:
        log(f"pretrain-moe: reusing the model in {out} ({SUMMARY_FILE} has the same settings)")
        return {**found, "reused": True}
    work = out / WORK
    trained = train(args, sizes, work, wanted)
    started = time.perf_counter()  # train's own wall_s covers everything before the export
    export_checkpoint(last_complete_checkpoint(work / "run"), work / "export")
    copy_model(work / "export", out)
    summary = {"model": str(out), **trained, "wall_s": trained["wall_s"] + time.perf_counter() - started}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    return summary


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/moe_pretrain", help="the checkpoint directory (default runs/moe_pretrain)")
    p.add_argument("--minutes", type=float, default=12.0, help="training-loop time budget (default 12)")
    p.add_argument("--steps", type=int, default=0, help="train exactly this many steps (no timing probe)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (default 0)")
    p.add_argument("--tiny", action="store_true", help="a tiny corpus, model and step count: seconds (tests)")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "pretrain-moe") -> Dict[str, Any]:
    args = parser(prog).parse_args(argv)
    try:
        if args.steps < 0:
            raise ValueError(f"--steps ({args.steps}) must be >= 0 (0 = from --minutes)")
        steps_for(args.minutes, 1.0)  # --minutes checked before anything runs
        summary = pretrain(args)
    except ValueError as err:
        exit_usage_error(prog, err)
    except CommandFailed as err:  # the export: the trained run stays in DIR/pretrain/run
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({k: v for k, v in summary.items() if k not in ("settings", "corpus")}))
    return summary
