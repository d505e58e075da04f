"""The family adapter: one transformers MoE family, as a subclass in its own module of this package, saying
what differs from the common case and nothing else (torchtitan's state_dict_adapter idea).

It holds what the checkpoint's config fixes: the expert count and sizes, which decoder layers are sparse
(Qwen's mlp_only_layers, DeepSeek's first_k_dense_replace), the routing rule (``moe.routing.NativeRule``),
the expert kind, what the block adds around the routed experts (``block``: shared experts, the gpt-oss
pair; families/blocks.py), and through ``FamilyLayout`` its keys and reading / writing its files. The
remote code of an export builds its classes from the stock class names and ``block`` (remote/), so a family
needs nothing there. Plain models: no parallel code here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch.nn as nn

from ....moe.config import MoEConfig
from ....moe.layer import MoELayer
from ....moe.routing import NativeRule
from ..adapters import activation_name
from ..upcycle import MoEBlock
from .blocks import BLOCKS
from .layout import FamilyLayout


class MoEFamily(FamilyLayout):
    """One family's adapter over a transformers config: counts, sparse layers, routing rule, block, keys."""

    model_type: ClassVar[str]
    expert_kind: ClassVar[str] = "gated"
    wrapper_model_types: ClassVar[Tuple[str, ...]] = ()
    """Model types of the configs that hold this family's as their text config (a vision-language model)."""
    wrapped_prefix: ClassVar[Tuple[str, str]] = ("", "")
    """(key prefix in memory, the same in a wrapper's files): how the files of such a wrapper name the text model."""
    causal_lm: ClassVar[Optional[str]] = None
    packs_by_position_ids: ClassVar[bool] = True
    """Whether transformers' attention for this family keeps sequences packed into one row apart when their
    position ids restart (task 'chat' packs conversations that way)."""
    """transformers' causal LM class name, where AutoModelForCausalLM does not map the model type to it."""
    block_kind: ClassVar[str] = "routed"
    """What the sparse block adds around the routed experts: a key of families/blocks.py BLOCKS."""

    @property
    def name(self) -> str:
        return self.model_type

    def sparse_layers(self) -> List[int]:
        """Indices of the decoder layers whose MLP is a sparse MoE block (the others stay dense)."""
        return list(range(self.config.num_hidden_layers))

    def balance_loss(self) -> Dict[str, Any]:
        """The NativeRule fields of the family's joint load-balance loss (added when output_router_logits is set)."""
        c = self.config
        return {"output_router_logits": bool(c.output_router_logits), "aux_loss_coef": float(c.router_aux_loss_coef)}

    def rule(self) -> NativeRule:
        weights = "renormalised" if self.config.norm_topk_prob else "scores"
        return NativeRule(top_k=self.config.num_experts_per_tok, weights=weights, **self.balance_loss())

    def check(self) -> None:
        """ValueError for a config this adapter cannot reproduce exactly."""
        self.rule().check_experts(self.num_experts())

    def check_no_jitter(self) -> None:
        """transformers multiplies the block's input by uniform noise in training when router_jitter_noise is
        set; reproducing it would need its random stream."""
        noise = getattr(self.config, "router_jitter_noise", 0.0)
        if noise:
            raise ValueError(f"{self.name} router_jitter_noise ({noise}) > 0 is not supported")

    def layer_config(self, base: MoEConfig) -> MoEConfig:
        """``base`` (the run's [moe] options) with everything the checkpoint fixes: sizes, count, expert kind."""
        num_experts = self.num_experts()
        return replace(
            base,
            dim=int(self.config.hidden_size),
            ffn_dim=self.ffn_dim(),
            num_experts=num_experts,
            max_experts=max(base.max_experts or num_experts, num_experts),
            min_experts=min(base.min_experts, num_experts),
            expert_kind=self.expert_kind,
            activation=self.activation(),
            expert_bias=self.expert_kind == "gpt_oss",
        )

    def activation(self) -> str:
        from transformers.activations import ACT2FN

        return activation_name(ACT2FN[self.config.hidden_act])

    def block(self, layer: MoELayer, mlp: nn.Module) -> MoEBlock:
        """The module that takes the stock sparse block ``mlp``'s place around the converted ``layer``."""
        return BLOCKS[self.block_kind](layer, mlp)
