"""import_moe: a transformers MoE model (any family of models/hf/families/) with every sparse block replaced,
in place, by an MoE block holding a ``moe.layer.MoELayer``: the family's own routing ('native') or DynMoE's
top-any, one expert module per logical expert, the shared experts kept as they are (the family's ``block``).

Shape legend: B batch, L sequence length, D model dim, T = B * L tokens, E experts.

Each block keeps its decoder layer's contract (same call, same return type; gpt-oss's returns a pair), so
attention, caches and ``generate()`` keep working. Its aux loss and its share of the family's joint
load-balance loss go to the collection the caller opened (moe/aux_collector.py), as for upcycled blocks:
transformers' own loss path reads router logits that our routers do not record, so the model's
``output_router_logits`` is switched off and the collection's owner (``HFCausalLM``) adds the loss instead.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from ...moe.adapters import is_adapter
from ...moe.config import MoEConfig
from ...moe.experts import ExpertBank, expert_param_specs, expert_with
from ...moe.layer import MoELayer, NativeRouter, TopAnyRouter
from .families import MoEFamily, family_of

ThresholdHook = Callable[[str, MoELayer], Tensor]
"""(block prefix, converted top-any layer) -> thresholds (E,): where threshold calibration plugs in."""


def sparse_blocks(model: nn.Module, family: MoEFamily) -> List[Tuple[str, nn.Module]]:
    """(prefix, decoder layer) of every sparse block, checked to hold the family's fused experts."""
    names = {id(m): n for n, m in model.named_modules()}
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", ""), model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers (model.layers) found")
    found = []
    for index in family.sparse_layers():
        mlp = layers[index].mlp
        if not isinstance(getattr(getattr(mlp, "experts", None), "gate_up_proj", None), torch.Tensor):
            raise ValueError(
                f"{names[id(mlp)]}: expected the {family.name} sparse MoE block (experts.gate_up_proj), "
                f"found {type(mlp).__name__}"
            )
        found.append((names[id(mlp)], layers[index]))
    return found


def converted_layer(family: MoEFamily, mlp: nn.Module, config: MoEConfig) -> MoELayer:
    """An MoE layer computing ``mlp``'s routed experts: one expert per fused slice, the router converted."""
    fused = {key: mlp.get_parameter(key) for key in family.fused_keys()}
    like = fused["experts.gate_up_proj"]
    names = [name for name, _ in expert_param_specs(config) if not is_adapter(name)]  # LoRA's come after: drawn later
    experts = [
        expert_with([tensors[n].detach() for n in names], config)
        for tensors in (family.expert_tensors(fused, e) for e in range(config.num_experts))
    ]
    rule = family.rule() if config.router == "native" else None
    layer = MoELayer(config, ExpertBank(config, experts), rule=rule).to(device=like.device, dtype=like.dtype)
    _copy_router(layer, family, mlp)
    return layer.train(mlp.training)


def _router_tensors(family: MoEFamily, mlp: nn.Module) -> Dict[str, Tensor]:
    """Router tensor name -> the block's tensor (DeepSeek's correction bias is a buffer, the rest parameters)."""
    state = dict(mlp.named_parameters()) | dict(mlp.named_buffers())
    return {name: state[key] for name, key in family.router_keys().items()}


def _copy_router(layer: MoELayer, family: MoEFamily, mlp: nn.Module) -> None:
    """The checkpoint's router tensors, in their own dtype (DeepSeek keeps its router in float32 in a bf16
    model and routes in float32): gate vectors of a top-any / top-k / top-p router start as its rows, and
    only a native router keeps its bias and correction bias (the others have no place for them)."""
    source = _router_tensors(family, mlp)
    router = layer.router
    router.weight = nn.Parameter(source["weight"].detach().clone())
    if isinstance(router, NativeRouter):
        if "bias" in source:
            router.bias = nn.Parameter(source["bias"].detach().clone())
        if "e_score_correction_bias" in source:
            router.e_score_correction_bias = source["e_score_correction_bias"].detach().clone()


def import_moe(
    hf_model: nn.Module, moe_config: Optional[MoEConfig] = None, *, thresholds: Optional[ThresholdHook] = None
) -> nn.Module:
    """Replace every sparse MoE block of ``hf_model`` in place (dense layers stay dense); returns the model.

    ``moe_config`` (default: router 'native') gives the routing and losses; sizes, expert count and expert
    kind come from the checkpoint. With router 'top_any' the gate vectors start as the router's rows and the
    thresholds at ``threshold_init`` (0 by default) until ``thresholds`` (a calibration) sets them per block.
    """
    family = family_of(hf_model)
    config = family.layer_config(moe_config if moe_config is not None else MoEConfig(router="native"))
    if thresholds is not None and config.router != "top_any":
        raise ValueError(f"thresholds: a threshold hook needs router 'top_any', router is {config.router!r}")
    for prefix, decoder_layer in sparse_blocks(hf_model, family):
        mlp = decoder_layer.get_submodule("mlp")
        layer = converted_layer(family, mlp, config)
        if thresholds is not None:
            _set_thresholds(layer, thresholds(prefix, layer), prefix)
        decoder_layer.mlp = family.block(layer, mlp).train(mlp.training)
    # transformers' loss path reads router logits recorded from its own router classes, which are gone;
    # the family's loss now comes from the aux collection (the NativeRule keeps the switch and the weight,
    # and stock_layout.stock_config puts the switch back when the model is written out).
    cast(Any, hf_model).config.output_router_logits = False
    return hf_model


def _set_thresholds(layer: MoELayer, values_E: Tensor, prefix: str) -> None:
    assert isinstance(layer.router, TopAnyRouter), "import_moe checked the router is top_any"
    threshold = layer.router.threshold
    if values_E.shape != threshold.shape:
        raise ValueError(f"thresholds for {prefix}: shape {tuple(values_E.shape)} != ({layer.num_experts},)")
    with torch.no_grad():
        threshold.copy_(values_E)
