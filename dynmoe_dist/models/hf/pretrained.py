"""Exported DynMoE models as transformers directories: write one, and ``from_pretrained`` it back.

Shape legend: E experts of a layer (its current count), D model dim.

Directory layout (what ``python -m dynmoe_dist.export`` writes):
  config.json        the base model's transformers config + a ``dynmoe`` section: MoE block indices, expert
                     count per layer, the MoE options (router, eval_k0, ...), and each layer's thresholds
  model.safetensors  the HF model with MoE blocks in place of the upcycled MLPs; one key set per logical
                     expert, ``...mlp.moe.experts.experts.{id}.w_in`` (ranks, ep size, replicas folded away)
  tokenizer files    the model's tokenizer
``from_pretrained(DIR)`` returns the HF model (its own output classes, so ``generate()`` works) with the
same MoE blocks, in eval mode; its outputs equal the trained model's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, cast

import torch
import torch.nn as nn

from ...moe.config import MoEConfig
from ...moe.layer import find_moe_layers
from .loading import _transformers
from .upcycle import upcycle_hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORMAT_VERSION = 1
# Fixed per layer by the export (the shape fields come from the MLP, the count from the checkpoint).
PER_LAYER_KEYS = ("dim", "ffn_dim", "num_experts", "max_experts", "expert_kind", "activation", "expert_bias")


def install_moe_blocks(model: nn.Module, moe: MoEConfig, blocks: Sequence[int], num_experts: Sequence[int]) -> None:
    """Upcycle block ``blocks[i]`` into ``num_experts[i]`` experts. Highest block first: an upcycled MLP
    leaves the list of dense MLPs, so lower indices stay valid."""
    if len(blocks) != len(num_experts):
        raise ValueError(f"MoE blocks ({list(blocks)}) and expert counts ({list(num_experts)}) differ in length")
    assert moe.max_experts is not None, "MoEConfig.__post_init__ fills max_experts"
    for block, count in sorted(zip(blocks, num_experts), reverse=True):
        layer_moe = dataclasses.replace(
            moe, num_experts=count, max_experts=max(count, moe.max_experts), min_experts=min(moe.min_experts, count)
        )
        upcycle_hf(model, layer_moe, layers=[block])


def moe_options(moe: MoEConfig) -> Dict:
    return {k: v for k, v in dataclasses.asdict(moe).items() if k not in PER_LAYER_KEYS}


def dynmoe_section(model: nn.Module, moe: MoEConfig, blocks: Sequence[int], **extra) -> Dict:
    layers = [layer for _, layer in find_moe_layers(model)]
    return {
        "format": FORMAT_VERSION,
        "moe_blocks": sorted(blocks),
        "num_experts": [m.num_experts for m in layers],
        "moe": moe_options(moe),
        "thresholds": [_thresholds(m.router) for m in layers],
        **extra,
    }


def _thresholds(router: nn.Module) -> Optional[List[float]]:
    """The router's per-expert thresholds (top-any); None for a router without them."""
    threshold = getattr(router, "threshold", None)
    return threshold.detach().cpu().tolist() if isinstance(threshold, torch.Tensor) else None


def unshared_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage; ties are restored on load)."""
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key in seen:
            continue
        seen.add(key)
        state[name] = t.detach().cpu().contiguous().clone()
    return state


def save_exported(model: nn.Module, section: Dict, out: Path, tokenizer=None) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = cast("PreTrainedModel", model).config  # an HF model
    config.dynmoe = section
    # A config read from GGUF names no architecture; from_pretrained needs it to pick the class.
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))
    save_file(unshared_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def load_weights(model: nn.Module, state: Dict[str, torch.Tensor], where: str) -> None:
    """Strict, except for tied weights that were saved once (they must share storage after tie_weights)."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{where}: keys the model does not have: {result.unexpected_keys[:5]}")
    cast("PreTrainedModel", model).tie_weights()  # an HF model
    params = dict(model.state_dict())
    loaded = {params[k].data_ptr() for k in state}
    untied = [k for k in result.missing_keys if params[k].data_ptr() not in loaded]
    if untied:
        raise ValueError(f"{where}: missing weights {untied[:5]}")


def read_section(directory: Path) -> Dict:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"from_pretrained: {str(directory)!r} has no config.json")
    section = json.loads(config_file.read_text()).get("dynmoe")
    if not isinstance(section, dict) or section.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"from_pretrained: {config_file} has no 'dynmoe' section of format {FORMAT_VERSION} "
            "(not written by python -m dynmoe_dist.export)"
        )
    return section


def from_pretrained(directory, *, eval_k0: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The exported HF model with its DynMoE blocks, in eval mode, in ``dtype`` (None: as saved).
    ``eval_k0`` overrides the exported choice for tokens that select no expert ('top1' fallback or
    'skip': MoE output 0)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    section = read_section(directory)
    tf = _transformers()
    config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    architecture = (config.architectures or [None])[0]
    model_class = getattr(tf, architecture, None) if architecture else None
    if model_class is None:
        raise ValueError(
            f"from_pretrained: config.json architectures ({config.architectures}) names no transformers model class"
        )
    state = load_file(str(directory / "model.safetensors"))
    dtype = dtype or next(iter(state.values())).dtype
    model = model_class(config).to(dtype)
    options = dict(section["moe"], **({"eval_k0": eval_k0} if eval_k0 is not None else {}))
    install_moe_blocks(model, MoEConfig(**options), section["moe_blocks"], section["num_experts"])
    load_weights(model, state, str(directory))
    return model.to(dtype).eval()


def expert_counts(model: nn.Module) -> List[int]:
    return [layer.num_experts for _, layer in find_moe_layers(model)]
