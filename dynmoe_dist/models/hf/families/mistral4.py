"""Mistral 4: softmax scores in the model's dtype, top-k within the expert groups whose top-2 scores sum
highest (DeepSeek's grouping without its sigmoid, correction bias or float32), renormalised if
norm_topk_prob, times routed_scaling_factor; DeepSeek-V3's dense first layers and shared experts, no
load-balance loss; its files keep the fused expert tensors. transformers' AutoModelForCausalLM does not know
it: its class is named (plain transformers loads an export with Mistral4ForCausalLM.from_pretrained)."""

from ....moe.routing import NativeRule
from .deepseek_v3 import DeepSeekV3


class Mistral4(DeepSeekV3):
    model_type = "mistral4"
    causal_lm = "Mistral4ForCausalLM"  # transformers 5.25's AutoModelForCausalLM leaves mistral4 out
    router_keys_in_block = {"weight": "gate.weight"}
    checkpoint_experts = None

    def rule(self) -> NativeRule:
        c = self.config
        return NativeRule(
            top_k=c.num_experts_per_tok,
            weights="renormalised" if c.norm_topk_prob else "scores",
            num_groups=c.n_group,
            top_groups=c.topk_group,
            scaling_factor=float(c.routed_scaling_factor),
            precision="model",
            **self.balance_loss(),
        )
