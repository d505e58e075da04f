"""A LoRA run out of the trainer: merged into its base weights, or as a PEFT adapter of the unchanged base.

Merged (``merge_adapters``): every adapter folded into the weight it adapts, W + (alpha / r) B A (a dense
projection's ``weight``; an expert's gate and up weights from the two row blocks of its input-side B, its
output weight from the output side), then removed, so the model is the plain model again and the source's
``save`` writes it as without LoRA (the stock format for native routing, remote code for top-any).

Unmerged (``save_peft_adapter``): PEFT 0.21's adapter directory (adapter_config.json,
adapter_model.safetensors) that ``PeftModel.from_pretrained(base, DIR)`` loads onto the base the run started
from. PEFT itself lays it out: its LoraConfig (``target_modules`` the attention projections by their qualified
names; ``target_parameters`` the fused experts and the dense MLPs' and shared experts' weights) is applied to
the base's skeleton on the meta device, each of its adapters is handed our numbers in its layout (a fused
expert tensor's lora_A (r*E, in): expert e's rows e*r .. (e+1)*r; lora_B (out, r*E): expert e's column j at
j*E + e, its rows in the order of the fused tensor's output features, ``gate_up_rows`` of the family) and
PEFT's ``save_pretrained`` writes it. Every imported family (tests/unit/test_lora_export.py). It
applies only where the base's experts are the run's (``unmerged_refusal`` says why not otherwise).

Shape legend: r rank, K a projection's input features, N its output features, F expert hidden dim, E experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from ..moe.adapters import SIDES, has_adapters, scaling
from ..moe.layer import MoELayer
from .lora import LoraConfig, dense_targets, moe_layers

FUSED_PARAMETERS = {"in": "gate_up_proj", "out": "down_proj"}
# Targets whose projections are called gate_proj / up_proj / down_proj: PEFT 0.21 reads those names in
# target_modules as transformers v4's expert names and retargets them to the fused experts (rank doubled), so
# they are named to it by their weights (target_parameters: a ParamWrapper of one "expert", the same delta).
MLP_TARGETS = ("dense_mlp", "shared_experts")
Adapter = Tuple[Tensor, Tensor]  # (lora_A, lora_B) in PEFT's layout


def export_lora(
    model: nn.Module,
    lora: LoraConfig,
    base: str,
    out: Path,
    unmerged: bool,
    save_merged: Callable[[nn.Module, Path], Path],
) -> Tuple[Path, Optional[str]]:
    """(the directory written, a one-line note or None): the PEFT adapter when ``unmerged`` is asked and applies;
    otherwise the model merged and written by ``save_merged`` (the source's own format), with the note saying
    why an asked-for adapter was not written."""
    if unmerged:
        try:
            return save_peft_adapter(model, lora, base, out), None
        except UnmergedRefused as refused:
            note: Optional[str] = f"{refused}; writing the merged model instead"
    else:
        note = None
    merge_adapters(model)
    return save_merged(model, out), note


class UnmergedRefused(ValueError):
    """An unmerged adapter cannot apply to the base (the message says why, in one line)."""


# -- merged ------------------------------------------------------------------------------------------------
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter of ``model`` into its weight and remove it (dense hooks too); the MoE layers'
    configs no longer ask for adapters, so what is saved or rebuilt from them is the plain model."""
    with torch.no_grad():
        for linear in _adapted_linears(model):
            linear.weight += _delta(linear, "lora_a", "lora_b", linear.weight)
            _strip(linear, ("lora_a", "lora_b", "lora_scaling"))
            cast(torch.utils.hooks.RemovableHandle, linear.lora_hook).remove()
            del linear.lora_hook
        for layer in moe_layers(model):
            for expert in layer.experts.experts:
                if has_adapters(expert):
                    _merge_expert(expert)
            layer.config.adapter_rank, layer.config.adapter_alpha = 0, 0.0


def _adapted_linears(model: nn.Module) -> List[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m, "lora_a")]


def _delta(module: nn.Module, a_name: str, b_name: str, like: Tensor) -> Tensor:
    """(alpha / r) B A of one adapter, (N, K), computed in float64 and cast to the weight's dtype."""
    a_rK, b_Nr = getattr(module, a_name).double(), getattr(module, b_name).double()
    return ((b_Nr @ a_rK) * scaling(module)).to(like.dtype)


def _merge_expert(expert: nn.Module) -> None:
    """The input side's delta rows are the gate's then the up's (one block for an ungated expert)."""
    in_weights = [cast(Tensor, getattr(expert, name)) for name in ("w_gate", "w_in") if hasattr(expert, name)]
    delta_in = _delta(expert, *SIDES["in"], like=cast(Tensor, expert.w_in))
    for weight, rows in zip(in_weights, delta_in.chunk(len(in_weights), dim=0)):
        weight.add_(rows)
    cast(Tensor, expert.w_out).add_(_delta(expert, *SIDES["out"], like=cast(Tensor, expert.w_out)))
    _strip(expert, (*SIDES["in"], *SIDES["out"], "lora_scaling"))


def _strip(module: nn.Module, names: Tuple[str, ...]) -> None:
    for name in names:
        delattr(module, name)


# -- unmerged ----------------------------------------------------------------------------------------------
def unmerged_refusal(model: nn.Module, lora: LoraConfig, base_config) -> Optional[str]:
    """Why an unmerged adapter cannot apply to the base the run started from (its transformers config; None when
    it can): experts upcycled from a dense base, a router converted to top-any, experts pruned or added."""
    from .hf.families import family_of, is_family

    layers = moe_layers(model)
    converted = sorted({layer.config.router for layer in layers} - {"native"})
    counts = [len(layer.experts) for layer in layers]
    family = family_of(base_config) if is_family(str(getattr(base_config, "model_type", ""))) else None
    base_num_experts = family.num_experts() if family is not None else 0
    if family is None:
        why = "its MoE layers were upcycled from the dense MLPs of a base that has no experts"
    elif converted:
        why = f"its routers were converted to {converted[0]!r}, which the base's own routing does not compute"
    elif any(count != base_num_experts for count in counts):
        why = f"its MoE layers hold {counts} experts where the base has {base_num_experts} in each"
    else:
        return None
    return f"an unmerged adapter applies only to the unchanged base, and this run's model differs: {why}"


def peft_config(model: nn.Module, lora: LoraConfig, base: str):
    """PEFT's LoraConfig of the run's adapters: the attention projections by qualified name, the MLPs' weights
    and the fused expert tensors as target_parameters (``peft_names``)."""
    from peft import LoraConfig as PeftLoraConfig

    names = list(peft_names(model, lora).values())
    modules = [name for name in names if not name.endswith(".weight")]
    parameters = [name for name in names if name.endswith(".weight")]
    if "routed_experts" in lora.targets:
        parameters += [f"experts.{FUSED_PARAMETERS[side]}" for side in SIDES]
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int, computes alpha / r in float
        target_modules=modules or None,
        target_parameters=parameters or None,
        base_model_name_or_path=base,
    )


def peft_names(model: nn.Module, lora: LoraConfig) -> Dict[str, str]:
    """Qualified name of every adapted dense projection -> how PEFT names it: the module (attention), or its
    weight (``MLP_TARGETS``, which PEFT would retarget by module name)."""
    found = dense_targets(model)
    return {
        name: f"{name}.weight" if target in MLP_TARGETS else name
        for target in lora.targets
        if target in found
        for name, _ in found[target]
    }


def save_peft_adapter(model: nn.Module, lora: LoraConfig, base: str, out: Path) -> Path:
    """``model``'s adapters as PEFT's adapter directory for the base at ``base`` (ValueError, one line, where
    ``unmerged_refusal`` says it cannot apply)."""
    from peft import get_peft_model
    from transformers import AutoConfig

    from .hf.families import family_of, new_causal_lm

    base_config = AutoConfig.from_pretrained(base, local_files_only=True)
    refusal = unmerged_refusal(model, lora, base_config)
    if refusal is not None:
        raise UnmergedRefused(refusal)
    with torch.device("meta"):
        skeleton = new_causal_lm(base_config)
    peft = get_peft_model(skeleton, peft_config(model, lora, base))
    _hand_over(peft, _adapters_by_peft_name(model, lora, family_of(base_config).gate_up_rows()))
    peft.save_pretrained(str(out))
    return out


def _hand_over(peft: nn.Module, ours: Dict[str, Adapter]) -> None:
    """Every adapter PEFT made on the skeleton gets ours (PEFT's name -> (lora_A, lora_B) in its layout); one PEFT
    made and we lack fails."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    for name, module in peft.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            key = f"{key}.{module.parameter_name}"
        if key not in ours:
            raise ValueError(f"PEFT adapts {key!r}, which has no adapter in the run's model")
        for part, value in zip(("lora_A", "lora_B"), ours[key]):
            getattr(module, part)["default"].weight = nn.Parameter(value.detach().clone(), requires_grad=False)


def _adapters_by_peft_name(model: nn.Module, lora: LoraConfig, gate_up_rows: Tensor) -> Dict[str, Adapter]:
    """PEFT's module (or parameter) name -> (lora_A, lora_B) in PEFT's layout; an expert's input-side B rows in
    the fused tensor's order (``gate_up_rows``)."""
    names = peft_names(model, lora)
    adapters = {names[name]: (m.lora_a, m.lora_b) for name, m in model.named_modules() if name in names}
    prefixes = {id(m): name for name, m in model.named_modules() if isinstance(m, MoELayer)}
    for layer in moe_layers(model):
        experts = list(layer.experts.experts)
        if not experts or not has_adapters(experts[0]):
            continue
        block = _block_prefix(model, prefixes[id(layer)])
        for side, (a_name, b_name) in SIDES.items():
            rows = gate_up_rows if side == "in" else slice(None)
            a_rK = torch.cat([getattr(e, a_name) for e in experts])  # (r*E, K)
            b_NrE = torch.stack([getattr(e, b_name)[rows] for e in experts], -1).flatten(1)  # (N, r*E): j*E + e
            adapters[f"{block}.experts.{FUSED_PARAMETERS[side]}"] = (a_rK, b_NrE)
    return cast(Dict[str, Adapter], adapters)


def _block_prefix(model: nn.Module, layer_name: str) -> str:
    """The sparse block (transformers' ``mlp``) that holds the MoE layer called ``layer_name``."""
    from .hf.stock_layout import imported_blocks

    for prefix, _ in imported_blocks(model):
        if layer_name.startswith(prefix + "."):
            return prefix
    raise ValueError(f"the MoE layer {layer_name!r} is in no imported sparse block")
