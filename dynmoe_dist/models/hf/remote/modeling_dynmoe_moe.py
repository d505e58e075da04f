"""transformers MoE models converted to DynMoE routing by dynmoe_dist and exported, for plain transformers
(``trust_remote_code=True``).

Copied verbatim into the exported directory; imports only torch and transformers (and dynmoe_layers.py,
configuration_dynmoe_moe.py beside it). ``DynMoE<Stock>ForCausalLM`` is the family's stock causal LM
``<Stock>ForCausalLM`` (its attention, norms, dense layers and KV cache untouched) with the sparse block of
every layer in ``config.dynmoe['moe_blocks']`` replaced by the MoE block ``config.dynmoe['block']`` names
(dynmoe_layers.py BLOCKS), computing what dynmoe_dist's import (models/hf/moe_import.py) computes: the
routed experts, plus the stock shared expert(s) where the family has them, returned as the (hidden, router
scores) pair where its decoder layer unpacks one (gpt-oss). The classes are made on first use from the name
config.json's auto_map asks for, so one rule serves every family.

The shared experts keep their stock keys (``model.layers.{i}.mlp.shared_expert.gate_proj.weight``...).
Auxiliary losses are not computed here (the config's output_router_logits stays off): fine-tuning the
exported model trains with the LM loss only.
"""

from typing import Any, Dict

import torch.nn as nn

from .configuration_dynmoe_moe import PREFIX, dynmoe_config_class, stock_class
from .dynmoe_layers import BLOCKS, DynMoELayer, install_moe

SUFFIX = "ForCausalLM"
_MADE: Dict[str, Any] = {}


def sparse_mlp(mlp: nn.Module, index: int) -> Any:
    """The stock block at ``index``, checked to be the family's sparse MoE block (a dense layer has no experts)."""
    if not hasattr(mlp, "experts"):
        raise ValueError(f"config.dynmoe: moe_blocks entry ({index}) is no sparse MoE block ({type(mlp).__name__})")
    return mlp


def install_family(model: Any) -> None:
    """A transformers model's sparse blocks (``model.model.layers``, every family) -> the section's MoE blocks."""
    config = model.config
    kind = config.dynmoe.get("block") if isinstance(config.dynmoe, dict) else None
    if kind not in BLOCKS:
        raise ValueError(f"config.dynmoe: block ({kind!r}) must be one of {sorted(BLOCKS)}")

    def make_block(layer: DynMoELayer, mlp: nn.Module, index: int) -> nn.Module:
        return BLOCKS[kind](layer, sparse_mlp(mlp, index))

    install_moe(model.model.layers, config.dynmoe, config.hidden_size, make_block)


def dynmoe_model_class(stock: Any) -> Any:
    """``stock`` (a transformers causal LM class) with the section's MoE blocks installed after its own init."""
    name = PREFIX + stock.__name__
    if name in _MADE:
        return _MADE[name]

    def __init__(self: Any, config: Any) -> None:
        stock.__init__(self, config)
        install_family(self)

    # a family that keeps its router in float32 in a bf16 / fp16 model (DeepSeek-V3's gate.weight): dynmoe_dist's
    # import keeps the router rows it starts from so, and so does the MoE block here
    keep = list(getattr(stock, "_keep_in_fp32_modules_strict", None) or [])
    if "gate.weight" in keep:
        keep.append("moe.router.weight")
    _MADE[name] = type(
        name,
        (stock,),
        {
            "__init__": __init__,
            "__module__": __name__,
            "config_class": dynmoe_config_class(stock.config_class),
            "_can_compile_fullgraph": False,  # the rows per expert are data dependent (nonzero)
            "_keep_in_fp32_modules_strict": keep or None,
        },
    )
    return _MADE[name]


def __getattr__(name: str) -> Any:
    """``DynMoE<Stock>ForCausalLM`` for any transformers causal LM class ``<Stock>ForCausalLM`` (PEP 562)."""
    return dynmoe_model_class(stock_class(__name__, name, SUFFIX))
