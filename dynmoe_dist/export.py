"""``python -m dynmoe_dist.export CHECKPOINT --out DIR``: a training checkpoint -> a transformers directory.

CHECKPOINT is a checkpoint directory or a run's output directory (its newest complete checkpoint).
The checkpoint is all it reads: the model is built without weights from the base's config files the run saved
in ``CHECKPOINT/model/`` (with its tokenizer; train/model_files.py, content hash checked), so the base at
model.path may have been moved or deleted. A checkpoint written before ``model/`` existed builds from model.path.

The checkpoint (train/checkpoint.py: meta.pt, dense/, experts_ep{r}.safetensors) holds dense parameters by their
name in the trainer's model and experts by (MoE layer, logical id, ``moe.experts.expert_key``), whatever
the world size, ep size, replicas and FSDP sharding were. The export builds the run's model with the same
builder the trainer used (models/build.py, from the checkpoint's [model] and [moe]), sets each MoE layer to
the checkpoint's expert count and experts, fills every dense parameter by its name (the dense state is a
torch.distributed.checkpoint directory read into full tensors on this one process, no process group),
and writes the transformers model inside with models/hf/pretrained.py (format 3: plain transformers loads
it with ``trust_remote_code=True``; docs/hf.md); ``dynmoe_dist.hf.from_pretrained`` reads it back. An
imported transformers MoE trained with its own routing (moe.router = 'native') is written back in its
stock format instead (models/hf/stock_layout.py): same model_type, the fused layout of the files, the
expert count of what remains; plain transformers loads it without trust_remote_code.
Only runs with model.source = 'hf' export (the built-in models are not transformers models).
A LoRA run (lora.enabled) is built with its adapters, filled, and written merged (each adapter folded into its
weight) in the same format, or with ``--adapter`` as a PEFT adapter directory of the base at model.path where
one can apply to it (models/lora_export.py; otherwise a one-line note and the merged model). Its checkpoint
holds only what trained (train/checkpoint_base.py): the model is built from the base at model.path, whose content
hash must be the run's (one line naming both otherwise), as a fresh run builds it, and each expert's frozen
weights are rebuilt from its recipe before the checkpoint's tensors go in.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union, cast

import torch
import torch.nn as nn

from .data.tokenizers import load_tokenizer
from .models.build import build_model
from .models.hf.export_files import MAX_SHARD_SIZE, prepare_out_dir, shard_size_bytes
from .models.lora import apply_lora, expert_config, fill_whole, held_experts, round_base
from .models.lora_export import export_lora
from .models.source import ModelSource
from .moe.experts import expert_key
from .moe.layer import dense_state_tensors, find_moe_layers, rebuild_experts
from .tasks.base import ModelNeeds
from .train.checkpoint import (
    checkpoint_or_last,
    read_checkpoint_dense,
    read_checkpoint_experts,
    read_checkpoint_meta,
    saved_expert_counts,
)
from .train.checkpoint_base import FROZEN_BASE, FrozenBase, LayerBase, recipes_from
from .train.model_files import checked_base, checked_definition, tokenizer_path
from .train.progress import WaitBar


def read_checkpoint(checkpoint: Path):
    """(meta, run config) of a run that can export: model.source = 'hf'."""
    meta, run = read_checkpoint_meta(checkpoint)
    if run.model.source != "hf":
        raise ValueError(
            f"CHECKPOINT ({str(checkpoint)!r}) was trained with model.source ({run.model.source!r}); "
            "only 'hf' runs export to a transformers directory"
        )
    return meta, run


def fill_experts(
    model: nn.Module, experts: Mapping[str, Dict], meta: Dict, where: Path, base: Optional[FrozenBase] = None
) -> None:
    """Each MoE layer at the checkpoint's expert count, its experts in logical-id order (replicas were
    saved once). ``base`` (a checkpoint without the frozen base): the source's base experts and how the run
    stored them, from which each expert's frozen weights are rebuilt as the run formed them
    (train/checkpoint_base.py)."""
    counts = saved_expert_counts(meta)
    layers = find_moe_layers(model)
    if len(layers) != len(counts):
        raise ValueError(f"{where}: the checkpoint has {len(counts)} MoE layers, the run's model {len(layers)}")
    recipes = recipes_from(meta["states"]["experts"]) if base is not None else []
    for index, ((_, layer), count) in enumerate(zip(layers, counts)):
        keys = [expert_key(index, e) for e in range(count)]
        missing = [key for key in keys if key not in experts]
        if missing:
            raise ValueError(f"{where}: expert {missing[0]} (layer/logical id) is in no experts_ep* file")
        params = [experts[key]["params"] for key in keys]
        if base is not None:
            rebuild = LayerBase(index, layer.config, layer.router.weight, base, recipes[index].formed)
            params = [rebuild.with_frozen(named, recipe) for named, recipe in zip(params, recipes[index].experts)]
        rebuild_experts(layer, count, params)


def fill_dense(model: nn.Module, dense: Mapping[str, torch.Tensor], where: Path, whole: bool = True) -> None:
    """The dense state (every parameter that is not an expert's, the routers' buffers), by its name in the
    trainer's model (the checkpoint's names); with ``whole`` false (a LoRA checkpoint: what trained) the rest
    keeps the base's weights."""
    named = dict(dense_state_tensors(model))
    unplaced = sorted(set(dense) - set(named))
    if unplaced:
        raise ValueError(f"{where}: dense parameter {unplaced[0]!r} has no place in {type(model).__name__}")
    missing = sorted(set(named) - set(dense))
    if missing and whole:
        raise ValueError(f"{where}: the checkpoint has no dense parameter {missing[0]!r}")
    with torch.no_grad():
        for name, value in dense.items():
            if named[name].shape != value.shape:
                raise ValueError(f"{where}: {name!r} is {tuple(value.shape)}, the model's {tuple(named[name].shape)}")
            named[name].copy_(value)


EXPORT_STAGES = 4  # build the model, read the checkpoint, fill its weights, write the folder


def export(
    checkpoint,
    out,
    max_shard_size: Union[int, str] = MAX_SHARD_SIZE,
    progress: bool = True,
    adapter: bool = False,
    base: Optional[str] = None,
) -> Path:
    """The export; ``progress`` shows a bar over its stages (reading and writing a large model takes minutes).
    A LoRA run is written merged, or with ``adapter`` as a PEFT adapter of its base (models/lora_export.py);
    ``base``: where its frozen base is now, when no longer at the run's model.path (its content hash checked)."""
    checkpoint, out = checkpoint_or_last(Path(checkpoint)), Path(out)
    meta, run = read_checkpoint(checkpoint)
    if adapter and not run.lora.enabled:
        raise ValueError(f"--adapter: CHECKPOINT ({str(checkpoint)!r}) is no LoRA run (lora.enabled is false)")
    if base is not None:
        if FROZEN_BASE not in meta["states"]["experts"]:
            raise ValueError(f"--base ({base!r}): CHECKPOINT ({str(checkpoint)!r}) holds every weight, reads no base")
        run = replace(run, model=replace(run.model, path=base))
    with WaitBar(f"exporting {checkpoint.name}", EXPORT_STAGES, "stage", enabled=progress) as bar:
        source, tokenizer = built_source(checkpoint, meta, run)
        bar.advance()
        dense, experts = read_checkpoint_dense(checkpoint), read_checkpoint_experts(checkpoint)
        bar.advance()
        # The checkpoint's dtype (float64 runs export float64; bf16 runs keep fp32 masters).
        dtype = next(iter(dense.values())).dtype
        whole = FROZEN_BASE not in meta["states"]["experts"]
        if whole:
            source.allocate(torch.device("cpu"))
            source.model.to(dtype)
        else:  # the frozen base read from model.path as a fresh run reads it
            source.place(torch.device("cpu"), dtype)
            source.fill(held_experts(source.model), torch.device("cpu"), fill_whole)
        base_experts = None if whole else FrozenBase(source.base_expert, run.lora.base_dtype)
        fill_experts(source.model, experts, meta, checkpoint, base_experts)
        fill_dense(source.model, dense, checkpoint, whole)
        round_base(source.model, run.lora)  # a low-precision base as the run held it, widened: merged onto that
        bar.advance()
        written = write(source, run, meta, out, tokenizer, max_shard_size, adapter)
        bar.advance()
    return written


def built_source(checkpoint: Path, meta: Dict, run) -> Tuple[ModelSource, Any]:
    """(the run's model source, with LoRA's adapters in place but no weights yet; the tokenizer). Built from the
    checkpoint's ``model/`` definition, or, for a checkpoint without the frozen base, from the base at
    model.path once its content hash is checked to be the run's."""
    saved = checked_definition(checkpoint, meta["states"].get("model"))
    tokenizer_at = str(saved) if saved else tokenizer_path(run)
    tokenizer = load_tokenizer(tokenizer_at, "task.tokenizer")
    needs = ModelNeeds("causal-lm", len(tokenizer), max_len=run.task.max_len, tokenizer=tokenizer_at)
    moe = replace(expert_config(run.moe, run.lora), base_dtype="run")  # held widened (round_base), then merged
    if FROZEN_BASE in meta["states"]["experts"]:
        checked_base(meta["states"].get("model"), run.model.path)
        source = build_model(run.model, moe, needs)
    else:
        source = build_model(run.model, moe, needs, definition=str(saved) if saved else run.model.path)
    if run.lora.enabled:
        apply_lora(source.model, run.lora)  # the adapters' places, filled from the checkpoint
    source.check_exportable()  # a base without remote-code classes fails before any weight is read
    return source, tokenizer


def write(source: ModelSource, run, meta: Dict, out: Path, tokenizer, max_shard_size, adapter: bool) -> Path:
    """The filled model into ``out``: as it is, a LoRA run's merged (in the source's own format), or its PEFT
    adapter (``adapter``; the base at model.path checked to be the run's) unless it cannot apply, which a
    one-line note on stderr says before the merged model is written."""
    step, base = int(meta["step"]), run.model.path
    if not run.lora.enabled:
        return source.save(out, tokenizer, step, base, max_shard_size)
    if adapter and FROZEN_BASE not in meta["states"]["experts"]:  # a LoRA checkpoint's base was checked when read
        checked_base(meta["states"].get("model"), base)

    def save_merged(_: nn.Module, where: Path) -> Path:  # the plain model's MoE options: no adapters left
        return replace(cast(Any, source), moe=run.moe).save(where, tokenizer, step, base, max_shard_size)

    hf_model = cast(Any, source.model).transformers_model()
    written, note = export_lora(hf_model, run.lora, base, out, adapter, save_merged)
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynmoe_dist.export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (OUT/checkpoints/step_000030), or a run's OUT: its newest one"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="a new or empty folder to write: config.json, the weights, the tokenizer (and, unless the run kept "
        "the model's own routing, moe.router = 'native', the remote code *.py that transformers loads it with)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="empty --out first when it holds an earlier export (only then: config.json and files, no folders, "
        "not the checkpoint's or the current directory)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        help=f"above this the weights go into shards with an index, as save_pretrained writes them "
        f"(default {MAX_SHARD_SIZE!r}, save_pretrained's; e.g. '5GB', '500MB')",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run (lora.enabled) as a PEFT adapter directory of its base (adapter_config.json, "
        "adapter_model.safetensors) instead of merged into the base's weights; only for native routing and "
        "experts unchanged (otherwise a note says why and the merged model is written)",
    )
    parser.add_argument(
        "--base",
        help="a LoRA run's base model where it is now, if moved from the run's model.path (its checkpoint holds only "
        "what trained; the base's content hash must be the one the run was trained from)",
    )
    args = parser.parse_args(argv)
    try:
        shard_size_bytes(args.max_shard_size)
        prepare_out_dir(Path(args.out), Path(args.checkpoint), args.overwrite)
        out = export(args.checkpoint, args.out, args.max_shard_size, adapter=args.adapter, base=args.base)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    print(json.dumps({"out": str(out), "files": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    main()
