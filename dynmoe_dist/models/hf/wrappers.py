"""Training wrappers: an upcycled transformers model seen by the trainer as one of the project's models.

Shape legend: B batch, L sequence length, V vocabulary.

The trainer calls ``model(**batch.inputs)`` and reads ``.logits`` and ``.aux_loss`` (``ModelOutput``). HF
models return their own output classes and cannot carry the MoE aux loss, so the wrapper runs the HF
model unchanged (its MoE blocks return plain tensors, which keeps ``generate()`` working on the model
inside) inside a collection of the aux losses its MoE blocks report (moe/aux_collector.py).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch import Tensor

from ...moe.aux_collector import collect_aux_losses
from ..transformer import ModelOutput


class HFCausalLM(nn.Module):
    """A causal LM (``AutoModelForCausalLM``) -> ModelOutput(logits_BLV, aux_loss)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def transformers_model(self) -> nn.Module:
        """The transformers model inside (its own output classes, ``generate()``, ``save_pretrained``)."""
        return self.hf

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
    ) -> ModelOutput:
        """``position_ids`` (B, L) that restart at 0 mark packed examples (data/packed.py): transformers then
        builds a block-diagonal causal mask from them, so no example attends to another. It does so only
        without a 2-D attention mask, so with position ids the mask serves the load-balance loss alone."""
        with collect_aux_losses() as aux:
            out = self.hf(
                input_ids=input_ids,
                attention_mask=attention_mask if position_ids is None else None,
                position_ids=position_ids,
                use_cache=False,
            )
        # The mask drops padding from an imported MoE family's joint load-balance loss, as transformers does.
        return ModelOutput(out.logits, aux.total(out.logits, attention_mask))
