"""An imported MoE model written back as save_pretrained writes it: its family's stock layout (the keys the
family adapter's ``to_checkpoint_layout`` gives, models/hf/families/layout.py), with the expert count of the
config reduced to what the model holds now (after removals): plain transformers loads it, no
trust_remote_code.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Union, cast

import torch.nn as nn
from torch import Tensor

from ...moe.layer import NativeRouter
from .export_files import MAX_SHARD_SIZE, save_weights
from .families import family_of
from .pretrained import unshared
from .upcycle import MoEBlock


# -- writing the stock checkpoint back -------------------------------------------------------------------
def imported_blocks(model: nn.Module) -> List[tuple]:
    """(prefix, block) of every MoE block of an imported model, in order (block i)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]


def _native_router(prefix: str, block: MoEBlock) -> NativeRouter:
    router = block.moe.router
    if not isinstance(router, NativeRouter):
        raise ValueError(
            f"{prefix}: router {block.moe.config.router!r} has no stock transformers equivalent; only router "
            "'native' can be written back in the checkpoint's layout (use python -m dynmoe_dist.export)"
        )
    return router


def stock_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The model's state as save_pretrained writes it: every MoE block's experts (in bank order) and router
    rows in the checkpoint's keys, every other key as it is. One expert count for all blocks (the stock
    config has one), native routers only."""
    blocks = imported_blocks(model)
    counts = [block.moe.num_experts for _, block in blocks]
    if len(set(counts)) > 1:
        raise ValueError(f"the stock layout has one expert count per model; the MoE blocks have {counts}")
    prefixes = [prefix for prefix, block in blocks if _native_router(prefix, block)]
    return family_of(model).to_checkpoint_layout(model.state_dict(), prefixes)


def stock_config(model: nn.Module) -> Any:
    """A copy of the model's config with its current expert count, and transformers' own load-balance switch
    back as the checkpoint had it (the import moved the loss to the aux collection)."""
    family = family_of(model)
    blocks = imported_blocks(model)
    config = copy.deepcopy(cast(Any, model).config)
    if blocks:
        family.with_num_experts(config, blocks[0][1].moe.num_experts)
        routers = [_native_router(prefix, block) for prefix, block in blocks]
        config.output_router_logits = any(router.rule.output_router_logits for router in routers)
    family_of(config)  # the reduced count must still route (DeepSeek's groups divide it, top-k fits)
    return config


def save_stock(model: nn.Module, directory: Union[str, Path], max_shard_size: Union[int, str] = MAX_SHARD_SIZE) -> Path:
    """Write the model as save_pretrained would: config.json (+ generation_config.json) and model.safetensors
    (shards + index above ``max_shard_size``) in the checkpoint's layout; ``from_pretrained`` loads it
    without trust_remote_code."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = unshared(stock_state_dict(model))
    config = stock_config(model)
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))
    save_weights(state, out, max_shard_size)
    return out
