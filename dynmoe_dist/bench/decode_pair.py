"""`bench generate --build DIR`: a stock Qwen3-MoE whose experts are most of a decode step, its native top-k/2
view and its top-any export, built offline and reproducibly for the decode-time target of issue 31 (item 4).

Why: on the project's 17.6 M-parameter pre-trained MoE the experts are a small part of a decode step (attention,
an 8192-word head, sampling and Python stay), so even native top-1 decodes at 0.82-0.90 of top-2's time and no
router can meet "export / native <= FLOPs ratio + 0.05". Here the experts are wide (hidden 512, expert width
2048) and the head small, so a step's time follows the experts it runs.

The steps (each reused when DIR/build.json records the same settings):
1. tokenizer: byte-level BPE (data/bpe.py) on the Rotten Tomatoes snippets the causal-lm task ships;
2. native: transformers' Qwen3MoeConfig at SIZES (bench/moe_checkpoint.py's Qwen3MoeShape), random init from
   the seed, save_pretrained to DIR/native with the tokenizer;
3. view: DIR/views/kK, the same weights with num_experts_per_tok = top-k / 2 (models/hf/topk_view.py, the
   frontier's native-kK views);
4. top-any: the project's own conversion, a training run on the snippets with moe.router = 'top_any' and the
   budget moe.target_k (calibration starts at it; the controller holds it), for a few steps at a learning
   rate so small (1e-6) that the experts stay the native's, then `python -m dynmoe_dist.export` of its last
   checkpoint to DIR/export (the remote-code directory users load).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List

from ..config import RunConfig, load_config
from ..data.bpe import padded_vocab, save_tokenizer, train_bpe
from ..models.hf.topk_view import model_with_k
from ..train.checkpoint import last_complete_checkpoint
from ..train.telemetry import METRICS_FILE, read_metrics
from .commands import export_checkpoint
from .moe_checkpoint import Qwen3MoeShape

BUILD_FILE = "build.json"
BUILD_PARTS = ("native", "views", "tokens", "run", "export")
"""The folders a build writes in DIR, in order; BUILD_FILE last."""
TOP_ANY_COMBINE = "softmax"
"""The router's probabilities renormalised over the chosen experts, as the frontier's top-any runs combine."""


@dataclass(frozen=True)
class PairSizes:
    """The stock model and the conversion run that makes its top-any export."""

    shape: Qwen3MoeShape
    """Its vocab is the BPE tokenizer's size (rounded up to 64 for the embedding rows)."""
    steps: int
    batch: int
    max_len: int
    num_samples: int
    """task.num_samples: 0 = every snippet."""
    lr: float


# 2 blocks of hidden 512 (8 heads of 64, 2 key/value heads), 32 gated experts of 2048, top-2, a 1024-word BPE:
# 203.7 M parameters, 98.8 % of them experts. A decode token reads 6.3 M expert weights per block at top-2 (3.1 M
# at top-1) against 0.66 M of attention per block and 0.5 M of head: 87 % of the weights a top-2 step reads are
# experts (77 % at top-1; the 17.6 M model: 35 %). A wider expert would raise that little further and double the
# memory; what stays besides is Python per block and per step. 32 experts: a batch-16 step of top-2 touches
# about 20 of them, of top-1 about 13 (each touched expert's weights are read once a step). 2 blocks keep the
# models (0.8 GB each) and the conversion run's optimizer state within a few GB. The run: 4 steps of 8 x 64
# tokens at lr 1e-6 (the thresholds' controller acts after every step whatever the lr).
FULL = PairSizes(
    shape=Qwen3MoeShape(
        num_layers=2, num_experts=32, top_k=2, hidden=512, moe_ffn=2048, vocab=1024, heads=8, kv_heads=2
    ),
    steps=4,
    batch=8,
    max_len=64,
    num_samples=0,
    lr=1e-6,
)
TINY = replace(
    FULL,
    shape=Qwen3MoeShape(num_layers=2, num_experts=8, top_k=2, hidden=64, moe_ffn=32, vocab=320, heads=2, kv_heads=1),
    steps=2,
    batch=4,
    max_len=16,
    num_samples=40,
)


def settings(sizes: PairSizes, target_k: float, seed: int) -> Dict[str, Any]:
    """What decides the pair, as it reads back from JSON (so a saved copy compares equal)."""
    return json.loads(json.dumps({"sizes": asdict(sizes), "target_k": target_k, "seed": seed}))


def check_target(sizes: PairSizes, target_k: float) -> float:
    """The budget: ``target_k``, or half the native top-k when 0 (the view's k)."""
    target = target_k or sizes.shape.top_k / 2
    if not 0 < target <= sizes.shape.num_experts:
        raise ValueError(f"--target-k ({target_k}) must be in (0, num_experts ({sizes.shape.num_experts})]")
    return target


def pair_paths(out: Path, top_k: int) -> Dict[str, Path]:
    return {"native": out / "native", "view": out / "views" / f"k{max(top_k // 2, 1)}", "export": out / "export"}


def build_pair(out: Path, sizes: PairSizes, target_k: float, seed: int) -> Dict[str, Any]:
    """The three directories (native, view, export) and what the build recorded; an earlier build with the same
    settings is reused, one with other settings refused (ValueError naming DIR)."""
    target = check_target(sizes, target_k)
    wanted = settings(sizes, target, seed)
    record = out / BUILD_FILE
    if record.is_file():
        built = json.loads(record.read_text())
        if built.get("settings") != wanted:
            raise ValueError(f"--build ({str(out)!r}) holds a pair built with other settings; choose another DIR")
        return built
    clear_partial_build(out)
    paths = pair_paths(out, sizes.shape.top_k)
    model = write_native(sizes, paths["native"], seed)
    model_with_k(paths["native"], max(sizes.shape.top_k // 2, 1), out / "views")
    final = convert(conversion_config(sizes, paths["native"], out / "run", target, seed))
    export_checkpoint(last_complete_checkpoint(out / "run"), paths["export"])
    built = {
        "settings": wanted,
        **{name: str(path) for name, path in paths.items()},
        "target_k": target,
        "calibrated_k": calibrated_k(out / "run"),
        **model,
        "conversion_test_loss": final["test_loss"],
    }
    record.write_text(json.dumps(built, indent=1))
    return built


def clear_partial_build(out: Path) -> None:
    """What a build that stopped half way left in DIR is removed; anything else there is refused."""
    found = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    foreign = [name for name in found if name not in BUILD_PARTS]
    if foreign:
        raise ValueError(f"--build ({str(out)!r}) holds {', '.join(foreign)} and no {BUILD_FILE}; choose another DIR")
    for name in found:
        shutil.rmtree(out / name)


def write_native(sizes: PairSizes, directory: Path, seed: int) -> Dict[str, Any]:
    """The tokenizer and the randomly initialised stock model in ``directory``; its parameter counts."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from ..tasks.causal_lm import rotten_tomatoes_snippets

    tokenizer = train_bpe(rotten_tomatoes_snippets(), sizes.shape.vocab)
    save_tokenizer(tokenizer, directory)
    config = replace(sizes.shape, vocab=padded_vocab(len(tokenizer))).hf_config()
    config.eos_token_id = config.pad_token_id = int(tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(str(directory))
    return parameter_counts(model, sizes.shape)


def parameter_counts(model: Any, shape: Qwen3MoeShape) -> Dict[str, Any]:
    """All parameters, the experts' share of them, and the experts' share of the weights one token reads at
    the native top-k (attention, router, norms and head being the rest)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    per_token_experts = experts * shape.top_k // shape.num_experts
    embedding = model.get_input_embeddings().weight.numel()  # a lookup: one row read, not the matrix
    read = total - experts + per_token_experts - embedding
    return {
        "parameters": total,
        "expert_share": round(experts / total, 4),
        "decode_expert_share": round(per_token_experts / read, 4),
    }


def conversion_config(sizes: PairSizes, native: Path, out_dir: Path, target_k: float, seed: int) -> RunConfig:
    """The top-any conversion of ``native`` on the Rotten Tomatoes snippets: no adaptive events (the export
    keeps every expert, as the native has them), one final checkpoint."""
    return load_config(
        None,
        [
            "task.name='causal-lm'",
            "task.path='rotten-tomatoes'",
            f"task.max_len={sizes.max_len}",
            f"task.num_samples={sizes.num_samples}",
            f"task.cache_dir='{(out_dir.parent / 'tokens').as_posix()}'",
            "task.prepare_workers=1",
            "model.source='hf'",
            f"model.path='{native.as_posix()}'",
            "moe.router='top_any'",
            f"moe.target_k={target_k}",
            f"moe.combine='{TOP_ANY_COMBINE}'",
            "train.epochs=1000",  # max_steps binds
            f"train.max_steps={sizes.steps}",
            f"train.global_batch_size={sizes.batch}",
            f"train.lr={sizes.lr}",
            "train.warmup_steps=0",
            f"train.seed={seed}",
            "adaptive.enabled=false",
            f"output.out_dir='{out_dir.as_posix()}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
            "output.keep_checkpoints=1",
        ],
    )


def calibrated_k(run_dir: Path) -> List[float]:
    """Per MoE layer, the mean k the conversion's calibration reached (its record in the run's metrics)."""
    (record,) = [r for r in read_metrics(run_dir / METRICS_FILE) if r["kind"] == "calibration"]
    return [round(float(layer["mean_k"]), 4) for layer in record["layers"]]


def convert(config: RunConfig) -> Dict[str, Any]:
    """The run in this process (one rank, no process group); its final record."""
    from ..train.run import run

    return run(config)
