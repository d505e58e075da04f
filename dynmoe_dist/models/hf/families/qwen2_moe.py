"""Qwen2-MoE: softmax top-k, renormalised if norm_topk_prob; dense layers by mlp_only_layers and
decoder_sparse_step; a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from typing import List

from .base import MoEFamily


class QwenMoE(MoEFamily):
    """Qwen2-MoE and Qwen3-MoE: dense layers by mlp_only_layers and decoder_sparse_step."""

    num_experts_key = "num_experts"

    def sparse_layers(self) -> List[int]:
        c = self.config
        return [
            i
            for i in range(c.num_hidden_layers)
            if i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        ]


class Qwen2MoE(QwenMoE):
    model_type = "qwen2_moe"
    block_kind = "shared_expert"
