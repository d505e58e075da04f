"""Qwen3-MoE: Qwen2-MoE's rule and dense layers, no shared expert."""

from .qwen2_moe import QwenMoE


class Qwen3MoE(QwenMoE):
    model_type = "qwen3_moe"
    num_experts_key = "num_local_experts"  # its config maps num_experts to this stored field
