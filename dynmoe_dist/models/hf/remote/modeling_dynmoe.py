"""DynMoE causal LMs upcycled from dense bases, exported by dynmoe_dist, for plain transformers
(``trust_remote_code=True``).

This file is copied verbatim into every exported directory and imports only torch and transformers (and
dynmoe_layers.py beside it): the directory loads, generates (KV cache included: only the MLPs change) and
evaluates without dynmoe_dist. Each model is the stock causal LM of its base with the MLP of every block
in ``config.dynmoe['moe_blocks']`` replaced by an MoE block (dynmoe_layers.py says what it computes);
GPT-2's block applies its MLP dropout after the MoE layer, as its MLP did.

The imported MoE families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss) live in
modeling_dynmoe_moe.py, so that a dense export loads with a transformers too old to know them.
Auxiliary losses are not computed here: fine-tuning the exported model trains with the LM loss only.
"""

from typing import Any

import torch.nn as nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

from .configuration_dynmoe import DynMoEGPT2Config, DynMoELlamaConfig, DynMoEMistralConfig, DynMoEQwen2Config
from .dynmoe_layers import DynMoEBlock, install_moe


def install_dense(blocks: nn.ModuleList, config: Any, dropout: float = 0.0) -> None:
    """Each chosen MLP's place: an MoE block (the dense MLP's weights live on in its experts)."""
    install_moe(blocks, config.dynmoe, config.hidden_size, lambda layer, mlp, index: DynMoEBlock(layer, dropout))


class DynMoELlamaForCausalLM(LlamaForCausalLM):
    config_class = DynMoELlamaConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoELlamaConfig):
        super().__init__(config)
        install_dense(self.model.layers, config)


class DynMoEQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = DynMoEQwen2Config
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEQwen2Config):
        super().__init__(config)
        install_dense(self.model.layers, config)


class DynMoEMistralForCausalLM(MistralForCausalLM):
    config_class = DynMoEMistralConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEMistralConfig):
        super().__init__(config)
        install_dense(self.model.layers, config)


class DynMoEGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = DynMoEGPT2Config
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEGPT2Config):
        super().__init__(config)
        # GPT2MLP applies dropout(resid_pdrop) to its output; the MoE block keeps it there.
        install_dense(self.transformer.h, config, config.resid_pdrop)
