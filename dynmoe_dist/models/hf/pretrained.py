"""Exported DynMoE models as transformers directories: write one, and ``from_pretrained`` it back.

Shape legend: E experts of a layer (its current count), D model dim.

Directory layout (format 2, what ``python -m dynmoe_dist.export`` writes; docs/hf.md):
  config.json        the base model's transformers config with a model type of our own (``dynmoe_llama``,
                     ``dynmoe_qwen2``, ``dynmoe_mistral``, ``dynmoe_gpt2``), ``architectures`` naming our
                     class, ``auto_map`` for AutoConfig / AutoModelForCausalLM, and a ``dynmoe`` section:
                     base model type and class, MoE block indices, expert count and expert shape per
                     layer, the MoE options (router, eval_k0, ...), each layer's thresholds
  configuration_dynmoe.py, modeling_dynmoe.py   copied from models/hf/remote/: plain transformers loads
                     the directory with ``trust_remote_code=True``, without dynmoe_dist, and refuses it
                     without (no stock class is named that would load it as the dense base model)
  model.safetensors  the HF model with MoE blocks in place of the upcycled MLPs; one key set per logical
                     expert, ``...mlp.moe.experts.experts.{id}.w_in`` (ranks, ep size, replicas folded away)
  tokenizer files    the model's tokenizer; generation_config.json
``from_pretrained(DIR)`` returns the HF model (its own output classes, so ``generate()`` works) with
dynmoe_dist's MoE blocks, in eval mode; its outputs equal the trained model's. It also reads format 1
(the base's config.json + the section; same weights), which plain transformers would misload.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, cast

import torch
import torch.nn as nn

from ...moe.config import MoEConfig
from ...moe.layer import find_moe_layers
from . import remote
from .loading import _transformers
from .upcycle import upcycle_hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
# base model type -> (config class, model class) in models/hf/remote/, the names auto_map points to
REMOTE_CLASSES = {
    "llama": ("DynMoELlamaConfig", "DynMoELlamaForCausalLM"),
    "qwen2": ("DynMoEQwen2Config", "DynMoEQwen2ForCausalLM"),
    "mistral": ("DynMoEMistralConfig", "DynMoEMistralForCausalLM"),
    "gpt2": ("DynMoEGPT2Config", "DynMoEGPT2LMHeadModel"),
}
# Keys of the base config the export does not carry: ours replace the first five; the export's weights are
# dense float tensors, so a GGUF base's quantization_config (gguf_file, quant_method) would make
# from_pretrained (lm-eval's loader among others) ask for a .gguf file the directory does not have; and
# _name_or_path is where the base came from, not the export.
EXPORT_KEYS = (
    "model_type",
    "architectures",
    "auto_map",
    "transformers_version",
    "dynmoe",
    "quantization_config",
    "_name_or_path",
    "_model_name_or_path",
)
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


def base_model_type(model: nn.Module) -> str:
    """The HF model type of ``model``, if the export has remote-code classes for it (ValueError if not)."""
    model_type = cast("PreTrainedModel", model).config.model_type
    if model_type not in REMOTE_CLASSES:
        raise ValueError(
            f"export: base model type ({model_type!r}) has no remote-code class in models/hf/remote/ "
            f"(supported: {', '.join(REMOTE_CLASSES)})"
        )
    return model_type


def expert_spec(config: MoEConfig) -> Dict:
    """What the remote code needs to build a layer's experts (the MoE options are shared)."""
    return {k: getattr(config, k) for k in ("expert_kind", "activation", "expert_bias", "ffn_dim")}


def dynmoe_section(model: nn.Module, moe: MoEConfig, blocks: Sequence[int], **extra) -> Dict:
    layers = [layer for _, layer in find_moe_layers(model)]
    return {
        "format": FORMAT_VERSION,
        "base_model_type": base_model_type(model),
        "base_architecture": type(model).__name__,
        "moe_blocks": sorted(blocks),
        "num_experts": [m.num_experts for m in layers],
        "experts": [expert_spec(m.config) for m in layers],
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
    return unshared(model.state_dict())


def unshared(full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``full`` without tied duplicates (the first name of each storage kept), as contiguous CPU copies."""
    state, seen = {}, set()
    for name, t in full.items():
        key = (t.data_ptr(), t.shape)
        if key in seen:
            continue
        seen.add(key)
        state[name] = t.detach().cpu().contiguous().clone()
    return state


def exported_config(model: nn.Module, section: Dict):
    """The base config as our remote config class: our model type, our class in architectures, auto_map."""
    from .remote import configuration_dynmoe

    config_name, model_name = REMOTE_CLASSES[section["base_model_type"]]
    base = cast("PreTrainedModel", model).config.to_dict()  # an HF model
    config = getattr(configuration_dynmoe, config_name)(**{k: v for k, v in base.items() if k not in EXPORT_KEYS})
    config.architectures = [model_name]
    config.auto_map = {
        "AutoConfig": f"configuration_dynmoe.{config_name}",
        "AutoModelForCausalLM": f"modeling_dynmoe.{model_name}",
    }
    config.dynmoe = section
    # The weights' dtype, so from_pretrained(dtype='auto') loads a float64 export as float64.
    config.dtype = next(model.parameters()).dtype
    return config


def save_exported(model: nn.Module, section: Dict, out: Path, tokenizer=None) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    exported_config(model, section).save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))
    for name in remote.REMOTE_FILES:  # verbatim: the directory needs no dynmoe_dist to load
        shutil.copyfile(Path(remote.__file__).parent / name, out / name)
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


def read_config(directory: Path) -> Dict:
    """config.json as a dict, with a ``dynmoe`` section of a readable format (ValueError if not)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"from_pretrained: {str(directory)!r} has no config.json")
    config = json.loads(config_file.read_text())
    section = config.get("dynmoe")
    if not isinstance(section, dict) or section.get("format") not in READABLE_FORMATS:
        formats = " or ".join(map(str, READABLE_FORMATS))
        raise ValueError(
            f"from_pretrained: {config_file} has no 'dynmoe' section of format {formats} "
            "(not written by python -m dynmoe_dist.export)"
        )
    return config


def base_model(directory: Path, config: Dict) -> nn.Module:
    """The base HF model (no weights yet) that the directory's MoE blocks go into. Format 2 names our
    remote classes, so the base config is rebuilt from its model type; format 1 names the base itself."""
    tf = _transformers()
    section = config["dynmoe"]
    if section["format"] == 1:
        hf_config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        architecture = (hf_config.architectures or [None])[0]
    else:
        fields = {k: v for k, v in config.items() if k not in EXPORT_KEYS}
        hf_config = tf.AutoConfig.for_model(section["base_model_type"], **fields)
        architecture = section["base_architecture"]
    model_class = getattr(tf, architecture, None) if architecture else None
    if model_class is None:
        raise ValueError(
            f"from_pretrained: {directory}: the base class ({architecture}) is no transformers model class"
        )
    return model_class(hf_config)


def from_pretrained(directory, *, eval_k0: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The exported HF model with its DynMoE blocks, in eval mode, in ``dtype`` (None: as saved).
    ``eval_k0`` overrides the exported choice for tokens that select no expert ('top1' fallback or
    'skip': MoE output 0)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_config(directory)
    section = config["dynmoe"]
    state = load_file(str(directory / "model.safetensors"))
    dtype = dtype or next(iter(state.values())).dtype
    model = base_model(directory, config).to(dtype)
    options = dict(section["moe"], **({"eval_k0": eval_k0} if eval_k0 is not None else {}))
    install_moe_blocks(model, MoEConfig(**options), section["moe_blocks"], section["num_experts"])
    load_weights(model, state, str(directory))
    return model.to(dtype).eval()


def expert_counts(model: nn.Module) -> List[int]:
    return [layer.num_experts for _, layer in find_moe_layers(model)]
