"""GLM-4.5 (glm4_moe): DeepSeek-V3's routing (sigmoid scores in float32, correction bias, group-limited top-k,
routed_scaling_factor, no load-balance loss), its always-on shared experts and first_k_dense_replace dense
layers, under its own model type."""

from .deepseek_v3 import DeepSeekV3


class Glm4Moe(DeepSeekV3):
    model_type = "glm4_moe"
