"""Configuration of a transformers MoE model imported into DynMoE routing (top-any, top-k or top-p) and
exported by dynmoe_dist (loaded with ``trust_remote_code=True``).

Copied verbatim into the exported directory; imports only transformers. Each class is the family's
config class with the ``dynmoe`` section configuration_dynmoe.py describes (format 3): base_model_type is
the family ('mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe', 'deepseek_v3', 'gpt_oss') and moe_blocks its
sparse layers (the dense ones stay dense). The family's expert count field keeps the checkpoint's count;
the section's num_experts is what each MoE block holds now. A separate file from the dense bases' so that
their exports load with a transformers that predates these families.
"""

from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig


class DynMoEMixtralConfig(MixtralConfig):
    model_type = "dynmoe_mixtral"


class DynMoEQwen2MoeConfig(Qwen2MoeConfig):
    model_type = "dynmoe_qwen2_moe"


class DynMoEQwen3MoeConfig(Qwen3MoeConfig):
    model_type = "dynmoe_qwen3_moe"


class DynMoEOlmoeConfig(OlmoeConfig):
    model_type = "dynmoe_olmoe"


class DynMoEDeepseekV3Config(DeepseekV3Config):
    model_type = "dynmoe_deepseek_v3"


class DynMoEGptOssConfig(GptOssConfig):
    model_type = "dynmoe_gpt_oss"
