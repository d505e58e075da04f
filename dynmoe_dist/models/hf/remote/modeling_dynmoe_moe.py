"""transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss) converted to DynMoE
routing by dynmoe_dist and exported, for plain transformers (``trust_remote_code=True``).

Copied verbatim into the exported directory; imports only torch and transformers (and dynmoe_layers.py
beside it). Each model is the family's stock causal LM (its attention, norms, dense layers and KV cache
untouched) with the sparse block of every layer in ``config.dynmoe['moe_blocks']`` replaced by an MoE block
(dynmoe_layers.py) that computes what dynmoe_dist's import (models/hf/moe_import.py) computes:

  Mixtral, Qwen3-MoE, OLMoE   the routed experts ('gated')
  Qwen2-MoE                   + sigmoid(shared_expert_gate(x)) * shared_expert(x), the stock modules
  DeepSeek-V3                 + shared_experts(x), the stock module
  gpt-oss                     the routed experts ('gpt_oss': clamped SwiGLU with biases), returned with the
                              combine weights as the (hidden, router scores) pair its decoder layer unpacks

The shared experts keep their stock keys (``model.layers.{i}.mlp.shared_expert.gate_proj.weight``...).
Auxiliary losses are not computed here (the config's output_router_logits stays off): fine-tuning the
exported model trains with the LM loss only.
"""

from typing import Any

import torch.nn as nn
from transformers import (
    DeepseekV3ForCausalLM,
    GptOssForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

from .configuration_dynmoe_moe import (
    DynMoEDeepseekV3Config,
    DynMoEGptOssConfig,
    DynMoEMixtralConfig,
    DynMoEOlmoeConfig,
    DynMoEQwen2MoeConfig,
    DynMoEQwen3MoeConfig,
)
from .dynmoe_layers import (
    DynMoEBlock,
    DynMoELayer,
    MakeBlock,
    RouterScoresBlock,
    SharedExpertBlock,
    SharedExpertsBlock,
    install_moe,
)


def sparse_mlp(mlp: nn.Module, index: int) -> Any:
    """The stock block at ``index``, checked to be the family's sparse MoE block (a dense layer has no experts)."""
    if not hasattr(mlp, "experts"):
        raise ValueError(f"config.dynmoe: moe_blocks entry ({index}) is no sparse MoE block ({type(mlp).__name__})")
    return mlp


def routed_block(layer: DynMoELayer, mlp: nn.Module, index: int) -> nn.Module:
    """Mixtral, Qwen3-MoE, OLMoE: the routed experts only."""
    sparse_mlp(mlp, index)
    return DynMoEBlock(layer)


def shared_expert_block(layer: DynMoELayer, mlp: nn.Module, index: int) -> nn.Module:
    """Qwen2-MoE: the stock shared expert and its sigmoid gate carried over."""
    stock = sparse_mlp(mlp, index)
    return SharedExpertBlock(layer, stock.shared_expert, stock.shared_expert_gate)


def shared_experts_block(layer: DynMoELayer, mlp: nn.Module, index: int) -> nn.Module:
    """DeepSeek-V3: the stock shared experts carried over."""
    return SharedExpertsBlock(layer, sparse_mlp(mlp, index).shared_experts)


def router_scores_block(layer: DynMoELayer, mlp: nn.Module, index: int) -> nn.Module:
    """gpt-oss: the (hidden, router scores) pair."""
    sparse_mlp(mlp, index)
    return RouterScoresBlock(layer)


def install_family(model: Any, make_block: MakeBlock) -> None:
    """A transformers model's sparse blocks (``model.model.layers``, every family) -> MoE blocks."""
    config = model.config
    install_moe(model.model.layers, config.dynmoe, config.hidden_size, make_block)


class DynMoEMixtralForCausalLM(MixtralForCausalLM):
    config_class = DynMoEMixtralConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEMixtralConfig):
        super().__init__(config)
        install_family(self, routed_block)


class DynMoEQwen2MoeForCausalLM(Qwen2MoeForCausalLM):
    config_class = DynMoEQwen2MoeConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEQwen2MoeConfig):
        super().__init__(config)
        install_family(self, shared_expert_block)


class DynMoEQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = DynMoEQwen3MoeConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEQwen3MoeConfig):
        super().__init__(config)
        install_family(self, routed_block)


class DynMoEOlmoeForCausalLM(OlmoeForCausalLM):
    config_class = DynMoEOlmoeConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEOlmoeConfig):
        super().__init__(config)
        install_family(self, routed_block)


class DynMoEDeepseekV3ForCausalLM(DeepseekV3ForCausalLM):
    config_class = DynMoEDeepseekV3Config
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)
    # transformers keeps DeepSeek's router (gate.weight) in float32 in a bf16 / fp16 model, and dynmoe_dist's
    # import keeps the router rows it starts from so: the gate vectors stay float32 here too
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "moe.router.weight"]

    def __init__(self, config: DynMoEDeepseekV3Config):
        super().__init__(config)
        install_family(self, shared_experts_block)


class DynMoEGptOssForCausalLM(GptOssForCausalLM):
    config_class = DynMoEGptOssConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEGptOssConfig):
        super().__init__(config)
        install_family(self, router_scores_block)
