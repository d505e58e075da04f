"""Configuration of a DynMoE model upcycled from a dense base, exported by dynmoe_dist (loaded with
``trust_remote_code=True``).

This file is copied verbatim into every exported directory and imports only transformers: the directory
loads without dynmoe_dist installed. Each class is its base model's config class with a ``dynmoe``
section (written by ``python -m dynmoe_dist.export``):

  format        3 (2: the same for dense bases, written before the MoE families and the combine option)
  base_model_type / base_architecture   the stock model the MoE blocks were upcycled from (or imported
                from: configuration_dynmoe_moe.py)
  moe_blocks    indices of the transformer blocks whose MLP is an MoE block (ascending)
  num_experts   experts per MoE block (they differ after experts were added or removed)
  experts       per MoE block: expert_kind ('gated', 'ffn' or 'gpt_oss'), activation, expert_bias,
                ffn_dim, and for 'gpt_oss' swiglu_alpha, swiglu_limit
  moe           the routing options: router ('top_any', 'top_k', 'top_p'), train_k0, eval_k0, combine,
                top_k, top_p
  thresholds    per MoE block, the top-any thresholds (informational: the weights file holds them)

The section is an extra config attribute, which transformers keeps and saves as it is: no ``__init__``
here (transformers 5 configs are dataclasses). A model type of our own per base (``dynmoe_llama``...):
transformers keys its auto classes by model type, and a stock type would let ``AutoModelForCausalLM``
build the dense base model and drop the experts.
"""

from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config


class DynMoELlamaConfig(LlamaConfig):
    model_type = "dynmoe_llama"


class DynMoEQwen2Config(Qwen2Config):
    model_type = "dynmoe_qwen2"


class DynMoEMistralConfig(MistralConfig):
    model_type = "dynmoe_mistral"


class DynMoEGPT2Config(GPT2Config):
    model_type = "dynmoe_gpt2"
