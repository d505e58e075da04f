"""Mixtral: softmax top-k, always renormalised; its files name the block block_sparse_moe and the experts
w1 (gate) / w3 (up) / w2 (down)."""

from ....moe.routing import NativeRule
from .base import MoEFamily


class Mixtral(MoEFamily):
    model_type = "mixtral"
    num_experts_key = "num_local_experts"
    ffn_key = "intermediate_size"
    checkpoint_block = "block_sparse_moe"
    checkpoint_experts = {"w_gate": "w1", "w_in": "w3", "w_out": "w2"}

    def rule(self) -> NativeRule:
        return NativeRule(top_k=self.config.num_experts_per_tok, **self.balance_loss())

    def check(self) -> None:
        super().check()
        self.check_no_jitter()
