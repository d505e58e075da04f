"""all-MiniLM-L6-v2 as a ``transformers.BertModel``: the model of the 'minilm-sentiment' and 'jsonl'
tasks (the tasks find its directory, tasks/assets.py, and tokenise with its tokenizer).

Shape legend: B batch, L max_len tokens, D hidden dim, C classes.

The classifier is encoder -> mean over real tokens (sentence-transformers' pooling for this model) -> a
fresh linear head, returning the project's ``ModelOutput``. Its MLPs are upcycled by ``upcycle_hf`` (the
BERT adapter: ``intermediate`` becomes the MoE block, ``output.dense`` an Identity, so dropout, residual
and LayerNorm stay where they were). Parameter names read ``bert.embeddings...``,
``bert.encoder.layer.N...``, ``head...``; ``freeze_names`` also accepts the short prefixes the run
files have always used (``embeddings``, ``layers.N``). Plain models: no parallel code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, cast

import torch.nn as nn
from torch import Tensor

from ...moe.aux_collector import collect_aux_losses
from ..transformer import ModelOutput, masked_mean
from .loading import _transformers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def ffn_shape(model_dir: Path) -> Tuple[int, int]:
    """(hidden size D, FFN width F) of one pre-trained block, from config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["hidden_size"]), int(config["intermediate_size"])


def load_minilm(model_dir, num_layers: Optional[int] = None, dropout: float = 0.0) -> nn.Module:
    """The pre-trained BertModel in ``model_dir`` (float32, training mode) keeping its first num_layers
    layers, no pooler."""
    tf = _transformers()
    # A str path: transformers treats a Path as a hub id in some versions. Dropout is set through the
    # config because BertModel builds its dropout modules from it.
    model = tf.AutoModel.from_pretrained(
        str(model_dir),
        local_files_only=True,
        dtype="float32",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    available = model.config.num_hidden_layers
    num_layers = available if num_layers is None else num_layers
    if not 1 <= num_layers <= available:
        raise ValueError(f"num_layers ({num_layers}) must be in [1, {available}] for {model_dir}")
    model.encoder.layer = model.encoder.layer[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.pooler = None  # a CLS projection the sentence-embedding model never uses: no dead parameters
    return model.train()


class HFSentenceClassifier(nn.Module):
    """transformers BertModel -> masked mean pool -> linear head; ``ModelOutput(logits_BC, aux_loss)``."""

    def __init__(self, bert: nn.Module, num_classes: int):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes ({num_classes}) must be >= 2")
        self.bert = bert
        self.head = nn.Linear(cast("PreTrainedModel", bert).config.hidden_size, num_classes)

    def embed(self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None, token_type_BL: Optional[Tensor] = None):
        """(mean-pooled sentence embeddings (B, D), aux loss)."""
        mask_BL = valid_BL.long() if valid_BL is not None else None
        with collect_aux_losses() as aux:
            h_BLD = self.bert(input_ids=tokens_BL, attention_mask=mask_BL, token_type_ids=token_type_BL)
        h_BLD = h_BLD.last_hidden_state
        return masked_mean(h_BLD, valid_BL), aux.total(h_BLD)

    def forward(
        self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None, token_type_BL: Optional[Tensor] = None
    ) -> ModelOutput:
        pooled_BD, aux = self.embed(tokens_BL, valid_BL, token_type_BL)
        return ModelOutput(self.head(pooled_BD), aux)


def freeze_names(prefixes: Sequence[str]) -> List[str]:
    """Short freeze prefixes as names of this classifier: 'embeddings' -> 'bert.embeddings', 'layers.N...'
    -> 'bert.encoder.layer.N...'; 'head' and names already under 'bert.' stay."""
    out = []
    for prefix in prefixes:
        if prefix == "embeddings" or prefix.startswith("embeddings."):
            prefix = "bert." + prefix
        elif prefix.startswith("layers."):
            prefix = "bert.encoder.layer." + prefix[len("layers.") :]
        out.append(prefix)
    return out
