"""The transformers MoE families a checkpoint can be imported from: one adapter per family (torchtitan's
state_dict_adapter idea), saying what differs between them and nothing else.

Shape legend: E experts, D model dim (hidden_size), F expert hidden dim, K chosen experts per token.

An expert lives in three layouts. Ours: one module per logical expert (``moe.experts``), nn.Linear layout.
transformers 5 in memory ("fused"): per sparse block P (``model.layers.i.mlp``)
  Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3: P.experts.gate_up_proj[e] (2F, D), gate rows 0:F, up rows F:2F;
    P.experts.down_proj[e] (D, F); router P.gate.weight (E, D) (+ DeepSeek's P.gate.e_score_correction_bias)
  gpt-oss: P.experts.gate_up_proj[e] (D, 2F), gate columns 0::2, up 1::2 (interleaved, transposed), and
    P.experts.gate_up_proj_bias[e] (2F) alike; P.experts.down_proj[e] (F, D), down_proj_bias[e] (D);
    router P.router.weight (E, D), P.router.bias (E)
The checkpoint files ("checkpoint": what save_pretrained writes and the hub holds): transformers fuses the
per-expert tensors on load and splits them again on save (its conversion_mapping.py), so the files keep
  Qwen2/3-MoE, OLMoE, DeepSeek-V3: P.experts.{e}.gate_proj / up_proj / down_proj.weight
  Mixtral: model.layers.i.block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down).weight, and its
    router as model.layers.i.block_sparse_moe.gate.weight
  gpt-oss: the fused tensors, as in memory

The routing rule (``moe.routing.NativeRule``) is read from the checkpoint's config here, and the dense
layers are told apart the family's way (Qwen's mlp_only_layers / decoder_sparse_step, DeepSeek's
first_k_dense_replace). Shared experts stay the family's own modules under their own names
(models/hf/moe_import.py), so their keys map to themselves. Plain models: no parallel code here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn
from torch import Tensor

from ...moe.config import MoEConfig
from ...moe.routing import NativeRule
from .adapters import activation_name
from .loading import read_config_json

Index = Tuple[Union[int, slice], ...]


@dataclass(frozen=True)
class ExpertSlice:
    """Where one expert parameter lives in a block's fused tensor: ``fused[(e, *index)]``, transposed when
    ``transpose`` (the checkpoint stores (in, out), the expert nn.Linear's (out, in))."""

    key: str
    """The fused tensor's key relative to the block (``experts.gate_up_proj``)."""
    index: Index
    """The expert's part of ``fused[e]`` (a half of gate_up, every other column of gpt-oss's)."""
    transpose: bool = False

    def full_index(self, expert: int) -> Index:
        return (expert, *self.index)

    def take(self, fused: Tensor, expert: int) -> Tensor:
        """The parameter of ``expert`` from the whole fused tensor (a view)."""
        part = fused[self.full_index(expert)]
        return part.t() if self.transpose else part

    def put(self, fused: Tensor, expert: int, value: Tensor) -> None:
        """Write ``value`` (the expert's parameter) into position ``expert`` of ``fused``: take's inverse."""
        fused[self.full_index(expert)] = value.t() if self.transpose else value


def _halves(ffn_dim: int) -> Dict[str, ExpertSlice]:
    """gate_up_proj (E, 2F, D) = [gate; up], down_proj (E, D, F): already nn.Linear's (out, in)."""
    return {
        "w_gate": ExpertSlice("experts.gate_up_proj", (slice(0, ffn_dim),)),
        "w_in": ExpertSlice("experts.gate_up_proj", (slice(ffn_dim, 2 * ffn_dim),)),
        "w_out": ExpertSlice("experts.down_proj", ()),
    }


def _interleaved(ffn_dim: int) -> Dict[str, ExpertSlice]:
    """gpt-oss: gate_up_proj (E, D, 2F) with gate/up interleaved along the last dim, down_proj (E, F, D), biases."""
    gate, up = slice(0, 2 * ffn_dim, 2), slice(1, 2 * ffn_dim, 2)
    return {
        "w_gate": ExpertSlice("experts.gate_up_proj", (slice(None), gate), transpose=True),
        "w_in": ExpertSlice("experts.gate_up_proj", (slice(None), up), transpose=True),
        "w_out": ExpertSlice("experts.down_proj", (), transpose=True),
        "b_gate": ExpertSlice("experts.gate_up_proj_bias", (gate,)),
        "b_in": ExpertSlice("experts.gate_up_proj_bias", (up,)),
        "b_out": ExpertSlice("experts.down_proj_bias", ()),
    }


class MoEFamily:
    """One family's adapter over a transformers config: counts, sparse layers, routing rule, key layout."""

    model_type: ClassVar[str]
    num_experts_key: ClassVar[str]
    """The config field holding the expert count (written back when experts were removed)."""
    ffn_key: ClassVar[str] = "moe_intermediate_size"
    router_name: ClassVar[str] = "gate"
    expert_kind: ClassVar[str] = "gated"
    checkpoint_block: ClassVar[str] = "mlp"
    """The sparse block's name in the checkpoint files (Mixtral's is block_sparse_moe)."""
    checkpoint_experts: ClassVar[Optional[Dict[str, str]]] = {
        "w_gate": "gate_proj",
        "w_in": "up_proj",
        "w_out": "down_proj",
    }
    """Expert parameter -> its module in the checkpoint's per-expert keys; None: the files keep the fused
    tensors (gpt-oss)."""

    def __init__(self, config: Any):
        self.config = config

    # -- what the config says ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.model_type

    def num_experts(self) -> int:
        return int(getattr(self.config, self.num_experts_key))

    def ffn_dim(self) -> int:
        return int(getattr(self.config, self.ffn_key))

    def sparse_layers(self) -> List[int]:
        """Indices of the decoder layers whose MLP is a sparse MoE block (the others stay dense)."""
        return list(range(self.config.num_hidden_layers))

    def balance_loss(self) -> Dict[str, Any]:
        """The NativeRule fields of the family's joint load-balance loss (added when output_router_logits is set)."""
        c = self.config
        return {"output_router_logits": bool(c.output_router_logits), "aux_loss_coef": float(c.router_aux_loss_coef)}

    def rule(self) -> NativeRule:
        weights = "renormalised" if self.config.norm_topk_prob else "scores"
        return NativeRule(top_k=self.config.num_experts_per_tok, weights=weights, **self.balance_loss())

    def layer_config(self, base: MoEConfig) -> MoEConfig:
        """``base`` (the run's [moe] options) with everything the checkpoint fixes: sizes, count, expert kind."""
        num_experts = self.num_experts()
        return replace(
            base,
            dim=int(self.config.hidden_size),
            ffn_dim=self.ffn_dim(),
            num_experts=num_experts,
            max_experts=max(base.max_experts or num_experts, num_experts),
            min_experts=min(base.min_experts, num_experts),
            expert_kind=self.expert_kind,
            activation=self.activation(),
            expert_bias=self.expert_kind == "gpt_oss",
        )

    def activation(self) -> str:
        from transformers.activations import ACT2FN

        return activation_name(ACT2FN[self.config.hidden_act])

    # -- the checkpoint's layout --------------------------------------------------------------------------
    def expert_layout(self) -> Dict[str, ExpertSlice]:
        """Expert parameter name -> where it lives in the block's fused tensors."""
        return _halves(self.ffn_dim())

    def fused_shapes(self, num_experts: int) -> Dict[str, Tuple[int, ...]]:
        """Fused tensor key (relative to the block) -> its shape for ``num_experts`` experts."""
        d, f = int(self.config.hidden_size), self.ffn_dim()
        return {"experts.gate_up_proj": (num_experts, 2 * f, d), "experts.down_proj": (num_experts, d, f)}

    def fused_keys(self) -> List[str]:
        return list(self.fused_shapes(0))

    def router_keys(self) -> Dict[str, str]:
        """Native router tensor name -> its key relative to the block."""
        return {"weight": f"{self.router_name}.weight"}

    def check(self) -> None:
        """ValueError for a config this adapter cannot reproduce exactly."""
        self.rule().check_experts(self.num_experts())

    def checkpoint_prefix(self, prefix: str) -> str:
        """The block's prefix in the checkpoint files (``...layers.3.block_sparse_moe`` for Mixtral)."""
        head, _, _ = prefix.rpartition(".")
        return f"{head}.{self.checkpoint_block}" if head else self.checkpoint_block

    def checkpoint_router_keys(self, prefix: str) -> Dict[str, str]:
        """Native router tensor name -> its full key in the checkpoint files."""
        block = self.checkpoint_prefix(prefix)
        return {name: f"{block}.{key}" for name, key in self.router_keys().items()}

    def checkpoint_expert_keys(self, prefix: str, expert: int) -> Dict[str, str]:
        """Expert parameter -> its full per-expert key in the checkpoint files (families that split them)."""
        assert self.checkpoint_experts is not None, f"{self.name} checkpoints keep the fused tensors"
        block = self.checkpoint_prefix(prefix)
        return {name: f"{block}.experts.{expert}.{module}.weight" for name, module in self.checkpoint_experts.items()}

    def with_num_experts(self, config: Any, num_experts: int) -> None:
        """Set the expert count of ``config`` (a copy being written back) to ``num_experts``."""
        setattr(config, self.num_experts_key, num_experts)


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
        # transformers multiplies the block's input by uniform noise in training; reproducing it would need its
        # random stream.
        if self.config.router_jitter_noise:
            raise ValueError(f"Mixtral router_jitter_noise ({self.config.router_jitter_noise}) > 0 is not supported")


class QwenMoE(MoEFamily):
    """Qwen2-MoE and Qwen3-MoE: dense layers by mlp_only_layers and decoder_sparse_step."""

    num_experts_key = "num_experts"

    def sparse_layers(self) -> List[int]:
        c = self.config
        return [
            i
            for i in range(c.num_hidden_layers)
            if i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
        ]


class Qwen2MoE(QwenMoE):
    model_type = "qwen2_moe"


class Qwen3MoE(QwenMoE):
    model_type = "qwen3_moe"
    num_experts_key = "num_local_experts"  # its config maps num_experts to this stored field


class OLMoE(MoEFamily):
    model_type = "olmoe"
    num_experts_key = "num_experts"
    ffn_key = "intermediate_size"


class DeepSeekV3(MoEFamily):
    model_type = "deepseek_v3"
    num_experts_key = "n_routed_experts"

    def sparse_layers(self) -> List[int]:
        return list(range(self.config.first_k_dense_replace, self.config.num_hidden_layers))

    def balance_loss(self) -> Dict[str, Any]:
        # DeepseekV3ForCausalLM adds no load-balance loss (it balances by the correction bias): coefficient 0.
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

    def router_keys(self) -> Dict[str, str]:
        return {"weight": "gate.weight", "e_score_correction_bias": "gate.e_score_correction_bias"}


class GptOss(MoEFamily):
    model_type = "gpt_oss"
    num_experts_key = "num_local_experts"
    ffn_key = "intermediate_size"
    router_name = "router"
    expert_kind = "gpt_oss"
    checkpoint_experts = None

    def rule(self) -> NativeRule:
        return NativeRule(
            top_k=self.config.num_experts_per_tok,
            scores="logits",
            weights="softmax",
            router_bias=True,
            precision="model",
            **self.balance_loss(),
        )

    def layer_config(self, base: MoEConfig) -> MoEConfig:
        config = super().layer_config(base)
        return replace(
            config, swiglu_alpha=float(self.config.swiglu_alpha), swiglu_limit=float(self.config.swiglu_limit)
        )

    def activation(self) -> str:
        return "silu"  # the clamped SwiGLU's own (hidden_act is not read by GptOssExperts)

    def expert_layout(self) -> Dict[str, ExpertSlice]:
        return _interleaved(self.ffn_dim())

    def fused_shapes(self, num_experts: int) -> Dict[str, Tuple[int, ...]]:
        d, f = int(self.config.hidden_size), self.ffn_dim()
        return {
            "experts.gate_up_proj": (num_experts, d, 2 * f),
            "experts.gate_up_proj_bias": (num_experts, 2 * f),
            "experts.down_proj": (num_experts, f, d),
            "experts.down_proj_bias": (num_experts, d),
        }

    def router_keys(self) -> Dict[str, str]:
        return {"weight": "router.weight", "bias": "router.bias"}


FAMILIES: Dict[str, Type[MoEFamily]] = {
    cls.model_type: cls for cls in (Mixtral, Qwen2MoE, Qwen3MoE, OLMoE, DeepSeekV3, GptOss)
}
SUPPORTED_MOE = tuple(FAMILIES)


def family_of(model_or_config: Any) -> MoEFamily:
    """The adapter of a transformers model (or its config), by model_type; checked against what it can
    reproduce. One-line ValueError naming an unsupported model type."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is no supported MoE family (supported: {', '.join(FAMILIES)})")
    family = FAMILIES[model_type](config)
    family.check()
    return family


def block_prefix(model: nn.Module, layer: int) -> str:
    """The state-dict prefix of decoder layer ``layer``'s MLP (``model.layers.3.mlp`` for a causal LM)."""
    base = getattr(model, "base_model_prefix", "")
    inner = getattr(model, base, None) if base else None
    return f"{base}.layers.{layer}.mlp" if isinstance(inner, nn.Module) else f"layers.{layer}.mlp"


def sparse_block_prefixes(model: nn.Module) -> List[str]:
    """State-dict prefixes of the model's sparse MoE blocks, in order: MoE block i is the i-th (stock or imported)."""
    family = family_of(model)
    return [block_prefix(model, layer) for layer in family.sparse_layers()]


def expert_tensors(family: MoEFamily, fused: Mapping[str, Tensor], expert: int) -> Dict[str, Tensor]:
    """Expert ``expert``'s parameters (views) from a block's fused tensors (key relative to the block)."""
    return {name: s.take(fused[s.key], expert) for name, s in family.expert_layout().items()}


def fuse_experts(family: MoEFamily, experts: Sequence[Mapping[str, Tensor]]) -> Dict[str, Tensor]:
    """The block's fused tensors (key relative to the block) holding ``experts`` in that order: the stock
    layout of a block whose experts were removed or reordered. expert_tensors' inverse."""
    like = experts[0]["w_in"]
    fused = {key: like.new_empty(shape) for key, shape in family.fused_shapes(len(experts)).items()}
    layout = family.expert_layout()
    with torch.no_grad():
        for position, params in enumerate(experts):
            for name, s in layout.items():
                s.put(fused[s.key], position, params[name].detach())
    return fused


# -- a run's model.path, seen before anything is built (config.load_config) ---------------------------------
# Config fields that hold an expert count in transformers' MoE configs: a config.json with one of them (and
# a non-zero value) describes an MoE, whether or not its family is supported.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ImportedMoE:
    """What a run's config needs to know of a transformers MoE at model.path, before it is built."""

    model_type: str
    num_experts: int
    top_k: int
    sparse_layers: Tuple[int, ...]
    correction_bias: bool = False
    """The native router has a choice-only bias (DeepSeek-V3's e_score_correction_bias): moe.balance 'bias' moves it."""


def imported_moe(directory: Path, field: str = "model.path") -> Optional[ImportedMoE]:
    """The MoE at ``directory`` (a save_pretrained directory), None for a dense model; a one-line ValueError
    naming the model type for an MoE family this project does not support, listing those it does."""
    raw = read_config_json(directory, f"{field} ({str(directory)!r})")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        counts = [key for key in EXPERT_COUNT_KEYS if isinstance(raw.get(key), int) and raw[key] > 0]
        if counts:
            raise ValueError(
                f"{field} ({str(directory)!r}) is a {model_type!r} mixture of experts ({counts[0]} = "
                f"{raw[counts[0]]}), which is not supported; supported MoE families: {', '.join(FAMILIES)}"
            )
        return None
    from transformers import AutoConfig

    family = family_of(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    top_k = int(family.config.num_experts_per_tok)
    correction = family.rule().correction_bias
    return ImportedMoE(model_type, family.num_experts(), top_k, tuple(family.sparse_layers()), correction)
