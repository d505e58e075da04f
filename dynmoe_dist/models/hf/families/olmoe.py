"""OLMoE: softmax top-k, renormalised if norm_topk_prob; every layer sparse."""

from .base import MoEFamily


class OLMoE(MoEFamily):
    model_type = "olmoe"
    num_experts_key = "num_experts"
    ffn_key = "intermediate_size"
