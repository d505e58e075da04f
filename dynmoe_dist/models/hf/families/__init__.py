"""The transformers MoE families a checkpoint can be imported from: one module per family, each one adapter
(``base.MoEFamily``) holding all the family knows, and this registry. Nothing outside models/hf/ names a
family (tests/unit/test_layering.py checks it): the rest of the project asks the adapter ``family_of`` gives.

Adding a family: one module with its adapter class, listed in FAMILIES below, and its tiny config in
tests/hf_tiny.py MOE_FAMILIES (which every family test is parametrized over).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Type

import torch.nn as nn

from ..loading import read_config_json
from .base import MoEFamily
from .deepseek_v3 import DeepSeekV3
from .glm4_moe import Glm4Moe
from .gpt_oss import GptOss
from .minimax_m2 import MiniMaxM2
from .mistral4 import Mistral4
from .mixtral import Mixtral
from .olmoe import OLMoE
from .qwen2_moe import Qwen2MoE
from .qwen3_5_moe import Qwen3_5Moe
from .qwen3_moe import Qwen3MoE

FAMILIES: Dict[str, Type[MoEFamily]] = {
    cls.model_type: cls
    for cls in (Mixtral, Qwen2MoE, Qwen3MoE, OLMoE, DeepSeekV3, GptOss, Glm4Moe, MiniMaxM2, Mistral4, Qwen3_5Moe)
}
SUPPORTED_MOE = tuple(FAMILIES)


def family_config(config: Any) -> Any:
    """``config``'s text config where ``config`` wraps a family's (Qwen3.5-MoE's vision-language model), else
    ``config``."""
    wrapped = {wrapper for cls in FAMILIES.values() for wrapper in cls.wrapper_model_types}
    return config.get_text_config() if getattr(config, "model_type", None) in wrapped else config


def family_of(model_or_config: Any) -> MoEFamily:
    """The adapter of a transformers model (or its config, or a config wrapping a family's), by model_type;
    checked against what it can reproduce. One-line ValueError naming an unsupported model type."""
    config = family_config(getattr(model_or_config, "config", model_or_config))
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is no supported MoE family (supported: {', '.join(FAMILIES)})")
    family = FAMILIES[model_type](config)
    family.check()
    return family


def is_family(model_type: str) -> bool:
    """Whether ``model_type`` is an MoE family this project imports (else a dense base, or unsupported)."""
    return model_type in FAMILIES


def packs_by_position_ids(model_type: str) -> bool:
    """Whether sequences packed into one row stay apart in ``model_type``'s attention when their position ids
    restart: a family says so; transformers' dense decoders all do (tests/unit/test_chat_packing.py)."""
    families = [cls for cls in FAMILIES.values() if model_type in (cls.model_type, *cls.wrapper_model_types)]
    return all(cls.packs_by_position_ids for cls in families)


def causal_lm_class(config: Any) -> Any:
    """transformers' class that builds and loads ``config``'s causal LM: AutoModelForCausalLM, or a family's own
    class where that mapping leaves the family out (Mistral 4 in transformers 5.25)."""
    import transformers

    family = FAMILIES.get(str(getattr(config, "model_type", "")))
    if family is not None and family.causal_lm is not None:
        return getattr(transformers, family.causal_lm)
    return transformers.AutoModelForCausalLM


def new_causal_lm(config: Any, **kwargs: Any) -> Any:
    """``config``'s causal LM, freshly initialised (``from_config``), by ``causal_lm_class``."""
    config = family_config(config)
    cls = causal_lm_class(config)
    return cls.from_config(config, **kwargs) if hasattr(cls, "from_config") else cls._from_config(config, **kwargs)


def block_prefix(model: nn.Module, layer: int) -> str:
    """The state-dict prefix of decoder layer ``layer``'s MLP (``model.layers.3.mlp`` for a causal LM)."""
    base = getattr(model, "base_model_prefix", "")
    inner = getattr(model, base, None) if base else None
    return f"{base}.layers.{layer}.mlp" if isinstance(inner, nn.Module) else f"layers.{layer}.mlp"


def sparse_block_prefixes(model: nn.Module) -> List[str]:
    """State-dict prefixes of the model's sparse MoE blocks, in order: MoE block i is the i-th (stock or imported)."""
    family = family_of(model)
    return [block_prefix(model, layer) for layer in family.sparse_layers()]


# -- a run's model.path, seen before anything is built (config.load_config) ---------------------------------
# Config fields that hold an expert count in transformers' MoE configs: a config.json with one of them (and
# a non-zero value) describes an MoE, whether or not its family is supported.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ImportedMoE:
    """What a run's config needs to know of a transformers MoE at model.path, before it is built."""

    model_type: str
    num_experts: int
    top_k: int
    sparse_layers: Tuple[int, ...]
    correction_bias: bool = False
    """The native router has a choice-only bias (DeepSeek-V3's e_score_correction_bias): moe.balance 'bias' moves it."""


def imported_moe(directory: Path, field: str = "model.path") -> Optional[ImportedMoE]:
    """The MoE at ``directory`` (a save_pretrained directory), None for a dense model; a one-line ValueError
    naming the model type for an MoE family this project does not support, listing those it does."""
    raw = read_config_json(directory, f"{field} ({str(directory)!r})")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES and not any(model_type in cls.wrapper_model_types for cls in FAMILIES.values()):
        counts = [key for key in EXPERT_COUNT_KEYS if isinstance(raw.get(key), int) and raw[key] > 0]
        if counts:
            raise ValueError(
                f"{field} ({str(directory)!r}) is a {model_type!r} mixture of experts ({counts[0]} = "
                f"{raw[counts[0]]}), which is not supported; supported MoE families: {', '.join(FAMILIES)}"
            )
        return None
    from transformers import AutoConfig

    family = family_of(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    top_k = int(family.config.num_experts_per_tok)
    correction = family.rule().correction_bias
    return ImportedMoE(family.name, family.num_experts(), top_k, tuple(family.sparse_layers()), correction)
