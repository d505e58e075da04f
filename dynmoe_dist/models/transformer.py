"""Plain transformer models with MoE feed-forward blocks in chosen layers. No parallel code here.

Shape legend: B batch, L sequence length, D model dim, H heads, V vocabulary, C classes.

Every model returns a ``ModelOutput``: the logits and the summed (already weighted) auxiliary loss
of its MoE layers. Blocks are pre-LayerNorm; ``moe_layers`` lists the block indices whose FFN is an
MoE layer (fresh, independently initialised experts: these models train from scratch).

The models take the run configuration's own ``ModelConfig`` (its [model] section, validated when it is
made, moe_layers included) and the ``MoEConfig`` of their MoE layers, whose dim and ffn_dim they set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..moe import FeedForward, MoEConfig, MoELayer, MoEOutput


class ModelShape(Protocol):
    """The fields these models read of ``dynmoe_dist.config.ModelConfig``. A type only: models sit below
    the run configuration in the layer order, so they name what they read instead of importing it."""

    dim: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    dropout: float
    moe_layers: List[int]
    patch_size: int


@dataclass
class ModelOutput:
    logits: Tensor
    aux_loss: Tensor


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) is not divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x_BLD: Tensor, attn_mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(x_BLD).view(B, L, 3, self.num_heads, D // self.num_heads).unbind(dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal and attn_mask is None,
        )
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


def feed_forward(x: Tensor, ffn: nn.Module):
    """Run a dense or MoE FFN; returns (output, aux loss or None)."""
    out = ffn(x)
    if isinstance(out, MoEOutput):
        return out.output, out.aux_loss
    return out, None


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.norm_attn = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, dropout)
        self.norm_ffn = nn.LayerNorm(dim)
        self.ffn = ffn
        self.drop = nn.Dropout(dropout)

    def forward(self, x_BLD: Tensor, attn_mask=None, causal: bool = False):
        x_BLD = x_BLD + self.drop(self.attn(self.norm_attn(x_BLD), attn_mask, causal))
        ffn_out, aux = feed_forward(self.norm_ffn(x_BLD), self.ffn)
        return x_BLD + self.drop(ffn_out), aux


class TransformerStack(nn.Module):
    """Blocks + final norm; sums the aux losses of the MoE blocks."""

    def __init__(self, model: ModelShape, moe: MoEConfig):
        super().__init__()
        moe_cfg = replace(moe, dim=model.dim, ffn_dim=model.ffn_dim)
        self.blocks = nn.ModuleList(
            Block(
                model.dim,
                model.num_heads,
                MoELayer(moe_cfg) if i in model.moe_layers else FeedForward(model.dim, model.ffn_dim),
                model.dropout,
            )
            for i in range(model.num_layers)
        )
        self.norm = nn.LayerNorm(model.dim)

    def forward(self, x_BLD: Tensor, attn_mask=None, causal: bool = False):
        aux = x_BLD.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x_BLD, block_aux = block(x_BLD, attn_mask, causal)
            if block_aux is not None:
                aux = aux + block_aux
        return self.norm(x_BLD), aux


def padding_attn_mask(valid_BL: Optional[Tensor]) -> Optional[Tensor]:
    """(B, L) bool of real tokens -> SDPA mask (B, 1, 1, L): every query may attend real keys."""
    return None if valid_BL is None else valid_BL[:, None, None, :]


def masked_mean(h_BLD: Tensor, valid_BL: Optional[Tensor]) -> Tensor:
    if valid_BL is None:
        return h_BLD.mean(dim=1)
    w_BL1 = valid_BL.unsqueeze(-1).to(h_BLD.dtype)
    return (h_BLD * w_BL1).sum(dim=1) / w_BL1.sum(dim=1).clamp(min=1)


class EncoderClassifier(nn.Module):
    """Token embedding + learned positions -> encoder -> masked mean pool -> linear classifier."""

    def __init__(self, model: ModelShape, moe: MoEConfig, vocab_size: int, max_len: int, num_classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model.dim)
        self.pos = nn.Parameter(torch.zeros(max_len, model.dim).normal_(0, 0.02))
        self.stack = TransformerStack(model, moe)
        self.head = nn.Linear(model.dim, num_classes)

    def forward(self, tokens_BL: Tensor, valid_BL: Optional[Tensor] = None) -> ModelOutput:
        x_BLD = self.embed(tokens_BL) + self.pos[: tokens_BL.shape[1]]
        h_BLD, aux = self.stack(x_BLD, padding_attn_mask(valid_BL))
        return ModelOutput(self.head(masked_mean(h_BLD, valid_BL)), aux)


class ViTClassifier(nn.Module):
    """Patch front end (non-overlapping patches, linear projection) + encoder + mean pool + head."""

    def __init__(self, model: ModelShape, moe: MoEConfig, image_size: int, channels: int, num_classes: int):
        super().__init__()
        patch_size = self.patch_size = model.patch_size
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) is not divisible by patch_size ({patch_size})")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(channels * patch_size * patch_size, model.dim)
        self.pos = nn.Parameter(torch.zeros(num_patches, model.dim).normal_(0, 0.02))
        self.stack = TransformerStack(model, moe)
        self.head = nn.Linear(model.dim, num_classes)

    def patches(self, images_BCHW: Tensor) -> Tensor:
        p = self.patch_size
        B, C, H, W = images_BCHW.shape
        x = images_BCHW.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def forward(self, images_BCHW: Tensor) -> ModelOutput:
        x_BLD = self.patch_embed(self.patches(images_BCHW)) + self.pos
        h_BLD, aux = self.stack(x_BLD)
        return ModelOutput(self.head(h_BLD.mean(dim=1)), aux)


class CausalLM(nn.Module):
    """Decoder-only language model: causal self-attention, LM head tied to the embedding."""

    def __init__(self, model: ModelShape, moe: MoEConfig, vocab_size: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model.dim)
        self.pos = nn.Parameter(torch.zeros(max_len, model.dim).normal_(0, 0.02))
        self.stack = TransformerStack(model, moe)

    def forward(self, tokens_BL: Tensor) -> ModelOutput:
        x_BLD = self.embed(tokens_BL) + self.pos[: tokens_BL.shape[1]]
        h_BLD, aux = self.stack(x_BLD, causal=True)
        return ModelOutput(h_BLD @ self.embed.weight.t(), aux)
