"""DeepSeek-V3: sigmoid scores, top-k of scores + correction bias within the best expert groups, scaled by
routed_scaling_factor, router in float32; first_k_dense_replace dense layers; always-on shared experts; no
load-balance loss (the correction bias balances)."""

from typing import Any, Dict, List

from ....moe.routing import NativeRule
from .base import MoEFamily


class DeepSeekV3(MoEFamily):
    model_type = "deepseek_v3"
    num_experts_key = "n_routed_experts"
    block_kind = "shared_experts"
    router_keys_in_block = {"weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias"}

    def sparse_layers(self) -> List[int]:
        return list(range(self.config.first_k_dense_replace, self.config.num_hidden_layers))

    def balance_loss(self) -> Dict[str, Any]:
        # its causal LM adds no load-balance loss (it balances by the correction bias): coefficient 0
        return {"output_router_logits": bool(self.config.output_router_logits), "aux_loss_coef": 0.0}

    def rule(self) -> NativeRule:
        c = self.config
        return NativeRule(
            top_k=c.num_experts_per_tok,
            scores="sigmoid",
            weights="renormalised" if c.norm_topk_prob else "scores",
            num_groups=c.n_group,
            top_groups=c.topk_group,
            scaling_factor=float(c.routed_scaling_factor),
            correction_bias=True,
            precision="float32",
            **self.balance_loss(),
        )
