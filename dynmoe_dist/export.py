"""``python -m dynmoe_dist.export CHECKPOINT --out DIR``: a training checkpoint -> a transformers directory.

The checkpoint (train/checkpoint.py: meta.pt, dense/, experts_ep{r}.pt) holds dense parameters by name
and experts by (MoE layer, logical id), whatever the world size, ep size, replicas and FSDP sharding were.
The dense state is a torch.distributed.checkpoint directory of shards; the export reads it into full
tensors on this one process, with no process group (train/dense_state.py: read_dense_params). The export
rebuilds the run's HF model (config from model.path, MoE blocks with the checkpoint's expert counts),
fills in every weight and writes it with models/hf/pretrained.py (format 2: plain transformers loads
it with ``trust_remote_code=True``; docs/hf.md); ``dynmoe_dist.hf.from_pretrained`` reads it back.
Only runs with model.source = 'hf' export (the built-in models are not transformers models).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn

from .models.hf.loading import load_model, load_tokenizer
from .models.hf.pretrained import base_model_type, dynmoe_section, install_moe_blocks, save_exported
from .moe.experts import expert_param_specs
from .moe.layer import find_moe_layers
from .parallel.migrate import expert_with
from .train.checkpoint import read_checkpoint_dense, read_checkpoint_experts, read_checkpoint_meta

WRAPPER_PREFIX = "hf."  # models/hf/wrappers.py: the trainer's model holds the HF model as .hf


def read_checkpoint(checkpoint: Path):
    """(meta, run config) of a run that can export: model.source = 'hf'."""
    meta, run = read_checkpoint_meta(checkpoint)
    if run.model.source != "hf":
        raise ValueError(
            f"CHECKPOINT ({str(checkpoint)!r}) was trained with model.source ({run.model.source!r}); "
            "only 'hf' runs export to a transformers directory"
        )
    return meta, run


def fill_dense(model: nn.Module, params: Dict[str, torch.Tensor], where: Path) -> None:
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            key = name[len(WRAPPER_PREFIX) :] if name.startswith(WRAPPER_PREFIX) else name
            if key not in named:
                raise ValueError(f"{where}: dense parameter {name!r} has no place in {type(model).__name__}")
            if named[key].shape != value.shape:
                raise ValueError(f"{where}: {name!r} is {tuple(value.shape)}, the model's {tuple(named[key].shape)}")
            named[key].copy_(value)


def fill_experts(model: nn.Module, experts: Dict[str, Dict], counts: List[int], where: Path) -> None:
    """Each layer's experts in logical-id order, one module per id (replicas were saved once)."""
    for index, (_, layer) in enumerate(find_moe_layers(model)):
        like = layer.router.weight
        modules = []
        for expert in range(counts[index]):
            key = f"{index}/{expert}"
            if key not in experts:
                raise ValueError(f"{where}: expert {key} (layer/logical id) is in no experts_ep*.pt file")
            params = experts[key]["params"]
            modules.append(expert_with([params[n].to(like) for n, _ in expert_param_specs(layer.config)], layer.config))
        layer.experts.set_experts(modules)


def export(checkpoint, out) -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    meta, run = read_checkpoint(checkpoint)
    counts = [int(n) for n in meta["num_experts"]]
    model = load_model(run.model.path, "causal-lm")
    base_model_type(model)  # a base without remote-code classes fails before any weight is read
    dense, experts = read_checkpoint_dense(checkpoint), read_checkpoint_experts(checkpoint)
    # The checkpoint's dtype (float64 runs export float64; bf16 runs keep fp32 masters).
    model = model.to(next(iter(dense.values())).dtype)
    blocks = sorted(run.model.moe_layers)
    install_moe_blocks(model, run.moe, blocks, counts)
    fill_dense(model, dense, checkpoint)
    fill_experts(model, experts, counts, checkpoint)
    tokenizer = load_tokenizer(run.task.tokenizer or run.model.path, "task.tokenizer")
    section = dynmoe_section(model, run.moe, blocks, step=int(meta["step"]), base_model=run.model.path)
    return save_exported(model.eval(), section, out, tokenizer)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynmoe_dist.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. OUT/checkpoints/step_000030")
    parser.add_argument(
        "--out", required=True, help="directory to write (config.json, remote code, model.safetensors, tokenizer)"
    )
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    print(json.dumps({"out": str(out), "files": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    main()
