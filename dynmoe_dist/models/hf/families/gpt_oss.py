"""gpt-oss: top-k of the logits of a router with a bias, softmax over the chosen; clamped SwiGLU experts with
biases, gate and up interleaved and transposed in gate_up_proj; its files keep the fused tensors; its MLP
returns (hidden, router scores)."""

from dataclasses import replace
from typing import Dict, Tuple

from ....moe.config import MoEConfig
from ....moe.routing import NativeRule
from .base import MoEFamily
from .layout import ExpertSlice


class GptOss(MoEFamily):
    model_type = "gpt_oss"
    num_experts_key = "num_local_experts"
    ffn_key = "intermediate_size"
    router_keys_in_block = {"weight": "router.weight", "bias": "router.bias"}
    expert_kind = "gpt_oss"
    block_kind = "router_scores"
    checkpoint_experts = None
    # transformers 5.25 builds gpt-oss's attention masks without the position ids: packed sequences would
    # attend to each other (tests/unit/test_chat_packing.py measures it)
    packs_by_position_ids = False

    def rule(self) -> NativeRule:
        return NativeRule(
            top_k=self.config.num_experts_per_tok,
            scores="logits",
            weights="softmax",
            router_bias=True,
            precision="model",
            **self.balance_loss(),
        )

    def layer_config(self, base: MoEConfig) -> MoEConfig:
        config = super().layer_config(base)
        return replace(
            config, swiglu_alpha=float(self.config.swiglu_alpha), swiglu_limit=float(self.config.swiglu_limit)
        )

    def activation(self) -> str:
        return "silu"  # the clamped SwiGLU's own (hidden_act is not read by GptOssExperts)

    def expert_layout(self) -> Dict[str, ExpertSlice]:
        """gate_up_proj (E, D, 2F), gate / up interleaved along the last dim, down_proj (E, F, D), biases."""
        f = self.ffn_dim()
        gate, up = slice(0, 2 * f, 2), slice(1, 2 * f, 2)
        return {
            "w_gate": ExpertSlice("experts.gate_up_proj", (slice(None), gate), transpose=True),
            "w_in": ExpertSlice("experts.gate_up_proj", (slice(None), up), transpose=True),
            "w_out": ExpertSlice("experts.down_proj", (), transpose=True),
            "b_gate": ExpertSlice("experts.gate_up_proj_bias", (gate,)),
            "b_in": ExpertSlice("experts.gate_up_proj_bias", (up,)),
            "b_out": ExpertSlice("experts.down_proj_bias", ()),
        }

    def fused_shapes(self, num_experts: int) -> Dict[str, Tuple[int, ...]]:
        d, f = int(self.config.hidden_size), self.ffn_dim()
        return {
            "experts.gate_up_proj": (num_experts, d, 2 * f),
            "experts.gate_up_proj_bias": (num_experts, 2 * f),
            "experts.down_proj": (num_experts, f, d),
            "experts.down_proj_bias": (num_experts, d),
        }
