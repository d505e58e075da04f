"""MiniMax-M2: sigmoid scores in float32, top-k of scores + a correction bias the sparse block holds (not its
router), always renormalised; its files are Mixtral's (block_sparse_moe, w1 / w3 / w2)."""

from ....moe.routing import NativeRule
from .mixtral import Mixtral


class MiniMaxM2(Mixtral):
    model_type = "minimax_m2"
    router_keys_in_block = {"weight": "gate.weight", "e_score_correction_bias": "e_score_correction_bias"}

    def rule(self) -> NativeRule:
        return NativeRule(
            top_k=self.config.num_experts_per_tok, scores="sigmoid", correction_bias=True, **self.balance_loss()
        )
