"""Exported DynMoE models as transformers directories: write one, and ``from_pretrained`` it back.

Shape legend: E experts of a layer (its current count), D model dim.

Two kinds of model export here: a dense base (LLaMA, Qwen2, Mistral, GPT-2) upcycled with DynMoE blocks, and
a transformers MoE model (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss) imported with top-any, top-k or
top-p routing (models/hf/moe_import.py; one with the family's own routing goes back to the stock layout
instead: stock_layout.save_stock).

Directory layout (format 3, what ``python -m dynmoe_dist.export`` writes; docs/hf.md):
  config.json        the base model's transformers config with a model type of our own (``dynmoe_llama``,
                     ``dynmoe_qwen2_moe``, ...: ``dynmoe_`` + the base's), ``architectures`` naming our
                     class, ``auto_map`` for AutoConfig / AutoModelForCausalLM, and a ``dynmoe`` section:
                     base model type and class, MoE block indices (an imported model's: its sparse layers),
                     expert count and expert spec per layer, the MoE options (router, eval_k0, combine,
                     ...), each layer's thresholds
  *.py               remote.REMOTE_FILES, copied from models/hf/remote/: plain transformers loads the
                     directory with ``trust_remote_code=True``, without dynmoe_dist, and refuses it without
                     (no stock class is named that would load it as the base model)
  model.safetensors  the HF model with MoE blocks in place of the upcycled MLPs or sparse blocks (above the
                     export's --max-shard-size: shards + model.safetensors.index.json, as save_pretrained
                     writes them; export_files.save_weights); one key set per logical expert,
                     ``...mlp.moe.experts.experts.{id}.w_in`` (ranks, ep size, replicas folded away); shared
                     experts under their stock keys
  tokenizer files    the model's tokenizer; generation_config.json
``from_pretrained(DIR)`` returns the HF model (its own output classes, so ``generate()`` works) with
dynmoe_dist's MoE blocks, in eval mode; its outputs equal the trained model's. It also reads format 2 (the
same for dense bases, before imported families and ``moe.combine``) and format 1 (the base's config.json +
the section; same weights), which plain transformers would misload.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn as nn

from ...moe.config import MoEConfig
from ...moe.experts import new_expert
from ...moe.layer import MoELayer, NativeRouter, find_moe_layers
from . import remote
from .export_files import MAX_SHARD_SIZE, save_weights
from .families import family_of, is_family
from .loading import _transformers, read_config_json
from .moe_import import import_moe
from .safetensors_reader import read_all
from .upcycle import upcycle_hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# 3: imported MoE families, gpt_oss experts (swiglu_alpha / swiglu_limit in the expert spec) and moe.combine,
# which a format-2 reader would misread (it would upcycle a Mixtral, or combine with 1/k)
FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
# dense base model type -> (config class, model class) in models/hf/remote/, the names auto_map points to; an
# imported family's are DynMoE + its stock class names, made on first use by the remote code (remote_classes)
DENSE_REMOTE_CLASSES = {
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
# Fixed per layer by the export (the shape fields come from the MLP or the imported checkpoint, the count from
# the trained model).
PER_LAYER_KEYS = (
    "dim",
    "ffn_dim",
    "num_experts",
    "max_experts",
    "expert_kind",
    "activation",
    "expert_bias",
    "swiglu_alpha",
    "swiglu_limit",
)
# What the remote code reads of the MoE options: every layer must agree with the section on them.
ROUTING_KEYS = ("router", "train_k0", "eval_k0", "combine", "top_k", "top_p")


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


def install_imported_blocks(
    model: nn.Module, moe: MoEConfig, blocks: Sequence[int], num_experts: Sequence[int]
) -> None:
    """Import the family model's sparse blocks (which must be ``blocks``) with options ``moe``, then give
    block i ``num_experts[i]`` placeholder experts and router rows: the export's weights fill them next."""
    family = family_of(model)
    if list(blocks) != family.sparse_layers():
        raise ValueError(
            f"MoE blocks ({list(blocks)}) are not the sparse layers of the {family.name} model "
            f"({family.sparse_layers()})"
        )
    if len(blocks) != len(num_experts):
        raise ValueError(f"MoE blocks ({list(blocks)}) and expert counts ({list(num_experts)}) differ in length")
    import_moe(model, moe)
    for (_, layer), count in zip(find_moe_layers(model), num_experts):
        placeholder_experts(layer, count)


def placeholder_experts(layer: MoELayer, count: int) -> None:
    """``count`` fresh experts and zero router rows (and thresholds), in the layer's dtypes."""
    like = next(layer.experts.parameters())
    layer.router.resize([], layer.router.weight.new_zeros(count, layer.router.weight.shape[1]))
    layer.experts.set_experts([new_expert(layer.config).to(like) for _ in range(count)])


def moe_options(moe: MoEConfig) -> Dict:
    return {k: v for k, v in dataclasses.asdict(moe).items() if k not in PER_LAYER_KEYS}


def base_model_type(model: nn.Module) -> str:
    """The HF model type of ``model``, if the export has remote-code classes for it (ValueError if not)."""
    model_type = cast("PreTrainedModel", model).config.model_type
    if model_type not in DENSE_REMOTE_CLASSES and not is_family(model_type):
        raise ValueError(
            f"export: base model type ({model_type!r}) has no remote-code class in models/hf/remote/ "
            f"(supported: {', '.join(DENSE_REMOTE_CLASSES)} and the imported MoE families)"
        )
    return model_type


def expert_spec(config: MoEConfig) -> Dict:
    """What the remote code needs to build a layer's experts (the MoE options are shared)."""
    spec = {k: getattr(config, k) for k in ("expert_kind", "activation", "expert_bias", "ffn_dim")}
    if config.expert_kind == "gpt_oss":  # the clamp constants are the checkpoint's, not the run's
        spec.update(swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
    return spec


def moe_block_indices(model: nn.Module, blocks: Optional[Sequence[int]], num_layers: int) -> List[int]:
    """The blocks whose MLP is an MoE block: ``blocks`` for an upcycled model, the family's sparse layers
    for an imported one (``blocks`` may be left out, or must name those)."""
    chosen = None if blocks is None else sorted(blocks)
    if is_family(base_model_type(model)):
        family = family_of(model)
        sparse = family.sparse_layers()
        if chosen is not None and chosen != sparse:
            raise ValueError(
                f"blocks ({chosen}) != the sparse layers of the {family.name} model ({sparse}): an imported "
                "model's MoE blocks are its sparse layers (leave blocks out)"
            )
        chosen = sparse
    elif chosen is None:
        raise ValueError("blocks: an upcycled model's export needs its MoE block indices (model.moe_layers)")
    if len(chosen) != num_layers:
        raise ValueError(f"blocks ({chosen}) name {len(chosen)} MoE blocks, the model has {num_layers} MoE layers")
    return chosen


def check_exportable(layers: Sequence[Tuple[str, MoELayer]], moe: MoEConfig) -> None:
    """ValueError for a layer the remote code cannot compute as the section says: a family's own routing
    (that goes back to the stock layout), or routing options other than the section's."""
    for name, layer in layers:
        if isinstance(layer.router, NativeRouter):
            raise ValueError(
                f"{name}: router 'native' (the family's own routing) has no remote-code export; write the model "
                "in its stock layout with models.hf.stock_layout.save_stock"
            )
        for key in ROUTING_KEYS:
            have, want = getattr(layer.config, key), getattr(moe, key)
            if have != want:
                raise ValueError(f"{name}: {key} ({have!r}) != the exported MoE options' {key} ({want!r})")


def dynmoe_section(model: nn.Module, moe: MoEConfig, blocks: Optional[Sequence[int]] = None, **extra) -> Dict:
    """The ``dynmoe`` section of an export of ``model`` (upcycled: ``blocks`` are its MoE blocks; imported:
    its sparse layers, ``blocks`` not needed) whose MoE layers were built with options ``moe``."""
    named = find_moe_layers(model)
    check_exportable(named, moe)
    layers = [layer for _, layer in named]
    model_type = base_model_type(model)
    # what an imported family's sparse block adds around the routed experts: the remote code builds it by name
    block = {"block": family_of(model).block_kind} if is_family(model_type) else {}
    return {
        "format": FORMAT_VERSION,
        "base_model_type": model_type,
        "base_architecture": type(model).__name__,
        "moe_blocks": moe_block_indices(model, blocks, len(layers)),
        "num_experts": [m.num_experts for m in layers],
        "experts": [expert_spec(m.config) for m in layers],
        "moe": moe_options(moe),
        "thresholds": [_thresholds(m.router) for m in layers],
        **block,
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


def remote_classes(model: nn.Module) -> Tuple[str, str, str, str]:
    """(configuration module, config class, modeling module, model class) in models/hf/remote/ for the model."""
    model_type = base_model_type(model)
    if is_family(model_type):
        config_name, model_name = (f"DynMoE{type(m).__name__}" for m in (cast("PreTrainedModel", model).config, model))
        return "configuration_dynmoe_moe", config_name, "modeling_dynmoe_moe", model_name
    config_name, model_name = DENSE_REMOTE_CLASSES[model_type]
    return "configuration_dynmoe", config_name, "modeling_dynmoe", model_name


def exported_config(model: nn.Module, section: Dict):
    """The base config as our remote config class: our model type, our class in architectures, auto_map."""
    config_module, config_name, model_module, model_name = remote_classes(model)
    config_class = getattr(importlib.import_module(f"{remote.__name__}.{config_module}"), config_name)
    base = cast("PreTrainedModel", model).config.to_dict()  # an HF model
    config = config_class(**{k: v for k, v in base.items() if k not in EXPORT_KEYS})
    config.architectures = [model_name]
    config.auto_map = {
        "AutoConfig": f"{config_module}.{config_name}",
        "AutoModelForCausalLM": f"{model_module}.{model_name}",
    }
    config.dynmoe = section
    # The weights' dtype, so from_pretrained(dtype='auto') loads a float64 export as float64.
    config.dtype = next(model.parameters()).dtype
    return config


def save_exported(
    model: nn.Module, section: Dict, out: Path, tokenizer=None, max_shard_size: Union[int, str] = MAX_SHARD_SIZE
) -> Path:
    """The export folder: config, generation config, remote code, weights (in shards above
    ``max_shard_size``, as save_pretrained writes them), tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    exported_config(model, section).save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))
    for name in remote.REMOTE_FILES:  # verbatim: the directory needs no dynmoe_dist to load
        shutil.copyfile(Path(remote.__file__).parent / name, out / name)
    save_weights(unshared_state(model), out, max_shard_size)
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
    config = read_config_json(directory, "from_pretrained")
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
    directory = Path(directory)
    config = read_config(directory)
    section = config["dynmoe"]
    state = read_all(directory)  # model.safetensors, or the shards its index names
    dtype = dtype or saved_dtype(config, state)
    model = base_model(directory, config).to(dtype)
    options = dict(section["moe"], **({"eval_k0": eval_k0} if eval_k0 is not None else {}))
    install = install_imported_blocks if is_family(section["base_model_type"]) else install_moe_blocks
    install(model, MoEConfig(**options), section["moe_blocks"], section["num_experts"])
    load_weights(model, state, str(directory))
    model.to(dtype).eval()
    keep_router_precision(model, state)
    return model


def saved_dtype(config: Dict, state: Dict[str, torch.Tensor]) -> torch.dtype:
    """The model's dtype as the export wrote it in config.json (the weights may mix dtypes: DeepSeek-V3's
    float32 router in a bf16 model); an export without it (format 1), its first tensor's."""
    name = config.get("dtype")
    saved = getattr(torch, name, None) if isinstance(name, str) else None
    return saved if isinstance(saved, torch.dtype) else next(iter(state.values())).dtype


def keep_router_precision(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """A family that routes in float32 (DeepSeek-V3) keeps its router rows in float32 in a bf16 / fp16 model,
    with the saved values: transformers keeps its gate.weight so, import_moe keeps the rows it copies from it,
    and the remote class keeps moe.router.weight so (its _keep_in_fp32_modules_strict)."""
    if not is_family(cast("PreTrainedModel", model).config.model_type):
        return
    if family_of(model).rule().precision != "float32":
        return
    for name, layer in find_moe_layers(model):
        weight = layer.router.weight
        if weight.dtype in (torch.bfloat16, torch.float16):
            saved = state[f"{name}.router.weight"].to(device=weight.device, dtype=torch.float32)
            layer.router.weight = nn.Parameter(saved, requires_grad=weight.requires_grad)


def expert_counts(model: nn.Module) -> List[int]:
    return [layer.num_experts for _, layer in find_moe_layers(model)]
