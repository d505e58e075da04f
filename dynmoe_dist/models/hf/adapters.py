"""Architecture adapters: find the dense MLPs of a transformers model and turn them into DynMoE layers.

Shape legend: D model (hidden) dim, F MLP intermediate dim.

One adapter per architecture family, like torchtitan's state_dict_adapter: it FINDS the dense MLPs by the
attributes their modules carry (never by hard-coded module paths, which differ between model classes and
transformers versions), converts each MLP's weights into one dense ``FeedForward`` / ``GatedFeedForward``
(the expert layout: nn.Linear's (out, in)), and knows how to put an MoE block in its place:

  gated   LLaMA / Qwen2 / Mistral (and any MLP with gate_proj, up_proj, down_proj, act_fn)
  gpt2    GPT2MLP: Conv1D c_fc / c_proj, whose weights are stored (in, out): transposed here
  split   BERT (and ViT in transformers 4.x): ``intermediate`` (dense + act) + ``output.dense``; the
          output's dropout, residual and LayerNorm stay outside the MoE (output.dense becomes Identity)
  fc      ViT in transformers 5.x: ``mlp`` with fc1 / fc2 / activation_fn

Plain models: no parallel code here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional, TypeVar, cast

import torch
import torch.nn as nn

from ...moe.experts import Expert, FeedForward, GatedFeedForward

if TYPE_CHECKING:
    from transformers.pytorch_utils import Conv1D

_Block = TypeVar("_Block", bound=nn.Module)

SUPPORTED = (
    "LLaMA / Qwen2 / Mistral (gate_proj, up_proj, down_proj)",
    "GPT-2 (Conv1D c_fc, c_proj)",
    "BERT (intermediate.dense + output.dense)",
    "ViT (mlp.fc1, mlp.fc2)",
)


@dataclass
class MLPSite:
    """One dense MLP of the model: where it is, its weights as a dense expert, and how to replace it."""

    name: str
    """Qualified module name of the MLP (or of the layer holding a split MLP), for messages."""
    convert: Callable[[], Expert]
    """The MLP's function as one dense expert (weights copied, same dtype and device); called only for
    the MLPs being upcycled (copying all of a 30-layer model's MLPs would double its memory)."""
    install: Callable[[nn.Module], None]
    """Put the MoE block (input D -> output D, the same function) where the MLP was."""
    dropout: Optional[nn.Module] = None
    """A dropout the MLP applied to its own output (GPT-2); the MoE block keeps applying it."""


def activation_name(act: nn.Module) -> str:
    """The MoEConfig activation that computes this HF activation module exactly."""
    kind = type(act).__name__
    if kind in ("SiLUActivation", "SiLU"):
        return "silu"
    if kind in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):
        return "gelu_tanh"
    if kind == "GELU":  # torch's own nn.GELU
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if kind == "GELUActivation":  # HF's erf GELU (its python variant is the same formula)
        return "gelu"
    if kind == "ReLU":
        return "relu"
    raise ValueError(
        f"activation module {kind} has no DynMoE equivalent (supported: SiLU, erf GELU, tanh GELU / gelu_new, ReLU)"
    )


def _dense_ffn(
    w_in_FD: torch.Tensor,
    b_in_F: Optional[torch.Tensor],
    w_out_DF: torch.Tensor,
    b_out_D: Optional[torch.Tensor],
    activation: str,
) -> FeedForward:
    block = FeedForward(w_in_FD.shape[1], w_in_FD.shape[0], bias=b_in_F is not None, activation=activation)
    return _filled(block, dict(w_in=w_in_FD, b_in=b_in_F, w_out=w_out_DF, b_out=b_out_D))


def _filled(block: _Block, values: Mapping[str, Optional[torch.Tensor]]) -> _Block:
    """``block`` with its parameters copied from ``values`` (name -> HF tensor), on their device and dtype."""
    like = values["w_in"]
    assert like is not None, "every dense expert has an input projection w_in"
    block = block.to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            value = values[name]
            assert value is not None, f"{name}: the block was built with this parameter because the HF MLP has it"
            p.copy_(value.detach())
    return block


def _replace_child(parent: nn.Module, child: str) -> Callable[[nn.Module], None]:
    return lambda block: setattr(parent, child, block)


def _children_with(model: nn.Module, test: Callable[[nn.Module], bool]):
    """(qualified name, parent, attribute, module) of every submodule passing ``test``, in module order."""
    found = []
    for parent_name, parent in model.named_modules():
        for child, module in parent.named_children():
            if test(module):
                found.append((f"{parent_name}.{child}" if parent_name else child, parent, child, module))
    return found


# -- gated: LLaMA / Qwen2 / Mistral -------------------------------------------------------------------
def _is_gated(m: nn.Module) -> bool:
    return all(
        isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")
    ) and isinstance(getattr(m, "act_fn", None), nn.Module)


def gated_sites(model: nn.Module) -> List[MLPSite]:
    sites = []
    for name, parent, child, mlp in _children_with(model, _is_gated):
        activation_name(mlp.act_fn)  # fail while finding, not halfway through upcycling
        sites.append(MLPSite(name, partial(_gated_dense, mlp), _replace_child(parent, child)))
    return sites


def _gated_dense(mlp: nn.Module) -> GatedFeedForward:
    # _is_gated checked these types
    gate, up, down = (cast(nn.Linear, getattr(mlp, a)) for a in ("gate_proj", "up_proj", "down_proj"))
    block = GatedFeedForward(
        up.in_features,
        up.out_features,
        bias=gate.bias is not None,
        activation=activation_name(cast(nn.Module, mlp.act_fn)),
    )
    return _filled(
        block,
        dict(w_gate=gate.weight, w_in=up.weight, w_out=down.weight, b_gate=gate.bias, b_in=up.bias, b_out=down.bias),
    )


# -- GPT-2: Conv1D stores weights (in, out) -----------------------------------------------------------
def _is_conv1d(m) -> bool:
    return type(m).__name__ == "Conv1D" and isinstance(getattr(m, "weight", None), torch.Tensor)


def _is_gpt2_mlp(m: nn.Module) -> bool:
    return (
        _is_conv1d(getattr(m, "c_fc", None))
        and _is_conv1d(getattr(m, "c_proj", None))
        and isinstance(getattr(m, "act", None), nn.Module)
    )


def gpt2_sites(model: nn.Module) -> List[MLPSite]:
    sites = []
    for name, parent, child, mlp in _children_with(model, _is_gpt2_mlp):
        act = activation_name(mlp.act)
        sites.append(
            MLPSite(
                name,
                partial(_gpt2_dense, mlp, act),
                _replace_child(parent, child),
                dropout=getattr(mlp, "dropout", None),
            )
        )
    return sites


def _gpt2_dense(mlp: nn.Module, activation: str) -> FeedForward:
    # Conv1D computes x @ W + b with W (in, out); the expert layout is nn.Linear's (out, in).
    c_fc, c_proj = cast("Conv1D", mlp.c_fc), cast("Conv1D", mlp.c_proj)  # _is_gpt2_mlp checked these
    return _dense_ffn(c_fc.weight.t(), c_fc.bias, c_proj.weight.t(), c_proj.bias, activation)


def _linear_pair_dense(fc_in: nn.Linear, fc_out: nn.Linear, activation: str) -> FeedForward:
    return _dense_ffn(fc_in.weight, fc_in.bias, fc_out.weight, fc_out.bias, activation)


# -- split: BERT (and ViT in transformers 4.x) --------------------------------------------------------
def _is_split_layer(m: nn.Module) -> bool:
    inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
    return (
        isinstance(getattr(inter, "dense", None), nn.Linear)
        and isinstance(getattr(inter, "intermediate_act_fn", None), nn.Module)
        and isinstance(getattr(out, "dense", None), nn.Linear)
    )


def split_sites(model: nn.Module) -> List[MLPSite]:
    sites = []
    for name, layer in model.named_modules():
        if not _is_split_layer(layer):
            continue
        inter, out = layer.intermediate, layer.output
        act = activation_name(inter.intermediate_act_fn)
        convert = partial(_linear_pair_dense, inter.dense, out.dense, act)

        def install(block, layer=layer):
            # The MoE block computes intermediate + output.dense; output keeps dropout, residual, LayerNorm.
            layer.intermediate = block
            layer.output.dense = nn.Identity()

        sites.append(MLPSite(name, convert, install))
    return sites


# -- fc: ViT in transformers 5.x ----------------------------------------------------------------------
def _is_fc_mlp(m: nn.Module) -> bool:
    return (
        isinstance(getattr(m, "fc1", None), nn.Linear)
        and isinstance(getattr(m, "fc2", None), nn.Linear)
        and isinstance(getattr(m, "activation_fn", None), nn.Module)
    )


def fc_sites(model: nn.Module) -> List[MLPSite]:
    sites = []
    for name, parent, child, mlp in _children_with(model, _is_fc_mlp):
        act = activation_name(mlp.activation_fn)
        sites.append(MLPSite(name, partial(_linear_pair_dense, mlp.fc1, mlp.fc2, act), _replace_child(parent, child)))
    return sites


ADAPTERS = {"gated": gated_sites, "gpt2": gpt2_sites, "split": split_sites, "fc": fc_sites}


def find_mlps(model: nn.Module) -> List[MLPSite]:
    """The dense MLPs of ``model`` in module order (index i = transformer block i), by the first adapter
    that recognises any. ValueError naming the model class when none does."""
    for finder in ADAPTERS.values():
        sites = finder(model)
        if sites:
            return sites
    raise ValueError(
        f"{type(model).__name__}: no dense MLP of a known architecture found; supported: {'; '.join(SUPPORTED)}"
    )
