"""Qwen3.5-MoE (its text causal LM, model type qwen3_5_moe_text): softmax top-k, always renormalised; every
layer sparse (its linear-attention and full-attention layers alike); Qwen2-MoE's shared expert scaled by
sigmoid(shared_expert_gate(x)); its files are Qwen2-MoE's (one key per expert). The hub's checkpoints are
the vision-language model (qwen3_5_moe), whose files hold the text model under model.language_model: its
text model is imported."""

from ....moe.routing import NativeRule
from .base import MoEFamily


class Qwen3_5Moe(MoEFamily):
    model_type = "qwen3_5_moe_text"
    wrapper_model_types = ("qwen3_5_moe",)  # the hub's checkpoints: the vision-language model
    wrapped_prefix = ("model.", "model.language_model.")
    num_experts_key = "num_experts"
    block_kind = "shared_expert"
    # its linear-attention layers (a causal convolution and the gated delta rule) run across the whole row:
    # restarting position ids do not reset them, so packed sequences would see each other
    # (tests/unit/test_chat_packing.py measures it)
    packs_by_position_ids = False

    def rule(self) -> NativeRule:
        return NativeRule(top_k=self.config.num_experts_per_tok, **self.balance_loss())
