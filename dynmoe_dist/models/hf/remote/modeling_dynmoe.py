"""DynMoE causal LMs exported by dynmoe_dist, for plain transformers (``trust_remote_code=True``).

This file is copied verbatim into every exported directory and imports only torch and transformers: the
directory loads, generates (KV cache included: only the MLPs change) and evaluates without dynmoe_dist.
Each model is the stock causal LM of its base with the MLP of every block in ``config.dynmoe['moe_blocks']``
replaced by an MoE block that computes what dynmoe_dist's training code computes:

  router    top-any (DynMoE): token t selects every expert e with sigmoid(cos(x_t, W_e)) > sigmoid(G_e),
            combine weight 1/k; a token selecting none gets its argmax expert with weight 1
            (eval_k0 / train_k0 'top1') or MoE output 0 ('skip' / 'zero'). top-k / top-p: softmax
            baselines. Gate math runs in at least float32, as in training.
  experts   'gated' (LLaMA / Qwen2 / Mistral: (act(x W_gate) * x W_in) W_out) or 'ffn' (GPT-2:
            act(x W_in + b_in) W_out + b_out), nn.Linear's (out, in) weight layout
  combine   out_t = sum over selected e of weight_te * expert_e(x_t); GPT-2 then applies its MLP dropout

State-dict keys (what model.safetensors holds): ``<block>.mlp.moe.router.weight`` (E, D),
``<block>.mlp.moe.router.threshold`` (E, top-any only), ``<block>.mlp.moe.experts.experts.<e>.w_in`` ...
Auxiliary losses are not computed here: fine-tuning the exported model trains with the LM loss only.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, R rows routed to one expert.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

from .configuration_dynmoe import DynMoEGPT2Config, DynMoELlamaConfig, DynMoEMistralConfig, DynMoEQwen2Config

FORMAT_VERSION = 2
SECTION_KEYS = ("moe_blocks", "num_experts", "experts", "moe")
COSINE_EPS = 1e-12


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# The expert activations of dynmoe_dist (moe/experts.py): 'gelu_tanh' is GPT-2's gelu_new.
ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


def gate_dtype(t: Tensor) -> torch.dtype:
    """Gate math never runs below float32 (bf16 / fp16 are upcast; float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def cosine_scores(x_TD: Tensor, gate_ED: Tensor) -> Tensor:
    """cos(x_t, W_e): both norms clamped at COSINE_EPS, the token norm dividing the (T, E) product."""
    dtype = torch.promote_types(gate_dtype(x_TD), gate_dtype(gate_ED))
    x_TD = x_TD.to(dtype)
    gate_ED = F.normalize(gate_ED.to(dtype), dim=-1, eps=COSINE_EPS)
    norm_T1 = torch.linalg.vector_norm(x_TD, dim=-1, keepdim=True).clamp_min(COSINE_EPS)
    return (x_TD @ gate_ED.t()) / norm_T1


def top_any(x_TD: Tensor, gate_ED: Tensor, threshold_E: Tensor, k0_mode: str) -> Tuple[Tensor, Tensor]:
    """(mask_TE, weights_TE). The 0/1 gate is a straight-through sign of relu(p - th), so a fine-tune
    still trains the router; tokens with k = 0 get the top-1 fallback (k0_mode 'top1') or nothing."""
    probs_TE = torch.sigmoid(cosine_scores(x_TD, gate_ED))
    r_TE = F.relu(probs_TE - torch.sigmoid(threshold_E.to(probs_TE.dtype)))
    gates_TE = r_TE + (torch.sign(r_TE) - r_TE).detach()
    mask_TE = gates_TE.detach() > 0
    num_selected_T = mask_TE.sum(dim=-1)
    weights_TE = gates_TE / num_selected_T.clamp(min=1).unsqueeze(-1).to(gates_TE.dtype)
    if k0_mode == "top1":
        best_TE = F.one_hot(probs_TE.detach().argmax(dim=-1), probs_TE.shape[-1]).bool()
        fallback_TE = best_TE & (num_selected_T == 0).unsqueeze(-1)
        mask_TE, weights_TE = mask_TE | fallback_TE, weights_TE + fallback_TE.to(weights_TE.dtype)
    return mask_TE, weights_TE


def top_k(logits_TE: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """Softmax, keep the k largest, renormalise the kept probabilities."""
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    index_TK = probs_TE.topk(k, dim=-1).indices
    mask_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(-1, index_TK, True)
    kept_TE = probs_TE * mask_TE
    return mask_TE, kept_TE / kept_TE.sum(dim=-1, keepdim=True)


def top_p(logits_TE: Tensor, p: float) -> Tuple[Tensor, Tensor]:
    """Softmax, keep the smallest descending prefix whose mass exceeds p (raw probabilities as weights)."""
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    sorted_TE, order_TE = probs_TE.detach().sort(dim=-1, descending=True)
    keep_sorted_TE = sorted_TE.cumsum(dim=-1) - sorted_TE <= p
    mask_TE = torch.zeros_like(keep_sorted_TE).scatter_(-1, order_TE, keep_sorted_TE)
    return mask_TE, probs_TE * mask_TE


class DynMoERouter(nn.Module):
    """Gate vectors (E, D) and, for top-any, per-expert thresholds (E,). Values come from the checkpoint."""

    def __init__(self, num_experts: int, dim: int, options: Dict[str, Any]):
        super().__init__()
        self.options = options
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.threshold = nn.Parameter(torch.zeros(num_experts)) if options["router"] == "top_any" else None

    def forward(self, x_TD: Tensor) -> Tuple[Tensor, Tensor]:
        if self.threshold is not None:
            k0_mode = self.options["train_k0"] if self.training else self.options["eval_k0"]
            return top_any(x_TD, self.weight, self.threshold, k0_mode)
        dtype = torch.promote_types(gate_dtype(x_TD), self.weight.dtype)
        logits_TE = x_TD.to(dtype) @ self.weight.to(dtype).t()
        if self.options["router"] == "top_k":
            return top_k(logits_TE, int(self.options["top_k"]))
        return top_p(logits_TE, float(self.options["top_p"]))


def _bias(size: int, on: bool) -> Optional[nn.Parameter]:
    return nn.Parameter(torch.zeros(size)) if on else None


def _linear(rows: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    # Weights are cast to the rows' dtype per call, as in training (bf16 rows, fp32 weights).
    return F.linear(rows, weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype))


class DynMoEExpert(nn.Module):
    """One expert: 'gated' (w_out(act(w_gate x) * w_in x)) or 'ffn' (w_out act(w_in x + b_in) + b_out)."""

    def __init__(self, dim: int, spec: Dict[str, Any]):
        super().__init__()
        ffn_dim, bias = int(spec["ffn_dim"]), bool(spec["expert_bias"])
        self.gated = spec["expert_kind"] == "gated"
        self.act = ACTIVATIONS[spec["activation"]]
        if self.gated:
            self.w_gate = nn.Parameter(torch.zeros(ffn_dim, dim))
        self.w_in = nn.Parameter(torch.zeros(ffn_dim, dim))
        self.w_out = nn.Parameter(torch.zeros(dim, ffn_dim))
        if self.gated:
            self.b_gate = _bias(ffn_dim, bias)
        self.b_in = _bias(ffn_dim, bias)
        self.b_out = _bias(dim, bias)

    def forward(self, rows_RD: Tensor) -> Tensor:
        hidden_RF = _linear(rows_RD, self.w_in, self.b_in)
        if self.gated:
            hidden_RF = self.act(_linear(rows_RD, self.w_gate, self.b_gate)) * hidden_RF
        else:
            hidden_RF = self.act(hidden_RF)
        return _linear(hidden_RF, self.w_out, self.b_out)


class DynMoEExperts(nn.Module):
    """Holds the experts as ``.experts`` (the state-dict keys of dynmoe_dist's ExpertBank)."""

    def __init__(self, num_experts: int, dim: int, spec: Dict[str, Any]):
        super().__init__()
        self.experts = nn.ModuleList(DynMoEExpert(dim, spec) for _ in range(num_experts))


class DynMoELayer(nn.Module):
    """router -> every expert on the tokens that selected it -> weighted sum; x (..., D) -> (..., D)."""

    def __init__(self, num_experts: int, dim: int, spec: Dict[str, Any], options: Dict[str, Any]):
        super().__init__()
        self.router = DynMoERouter(num_experts, dim, options)
        self.experts = DynMoEExperts(num_experts, dim, spec)

    def forward(self, x: Tensor) -> Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        mask_TE, weights_TE = self.router(x_TD)
        out_TD = x_TD.new_zeros(x_TD.shape)
        for e, expert in enumerate(self.experts.experts):
            token_R = mask_TE[:, e].nonzero().squeeze(-1)
            if token_R.numel() == 0:
                continue
            rows_RD = expert(x_TD.index_select(0, token_R))
            weight_R1 = weights_TE[token_R, e].to(rows_RD.dtype).unsqueeze(-1)
            out_TD = out_TD.index_add(0, token_R, rows_RD * weight_R1)
        return out_TD.reshape(x.shape).to(x.dtype)


class DynMoEBlock(nn.Module):
    """In the place of a block's MLP: the MoE layer as ``.moe``, then the MLP's own output dropout."""

    def __init__(self, moe: DynMoELayer, dropout: float = 0.0):
        super().__init__()
        self.moe = moe
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.moe(x))


def check_section(section: Any, num_blocks: int) -> Dict[str, Any]:
    """The config's dynmoe section, or a one-line ValueError saying what is wrong with it."""
    if not isinstance(section, dict) or section.get("format") != FORMAT_VERSION:
        raise ValueError(f"config.dynmoe must be a section of format {FORMAT_VERSION}, got {section!r:.80}")
    missing = [k for k in SECTION_KEYS if k not in section]
    if missing:
        raise ValueError(f"config.dynmoe lacks {missing}: not written by python -m dynmoe_dist.export")
    blocks, counts, specs = section["moe_blocks"], section["num_experts"], section["experts"]
    if not len(blocks) == len(counts) == len(specs):
        raise ValueError(f"config.dynmoe: moe_blocks ({blocks}), num_experts ({counts}), experts differ in length")
    for block in blocks:
        if not 0 <= block < num_blocks:
            raise ValueError(f"config.dynmoe: moe_blocks entry ({block}) out of range 0..{num_blocks - 1}")
    return section


def install_moe(blocks: nn.ModuleList, section: Dict[str, Any], dim: int, dropout: float = 0.0) -> None:
    """Replace ``blocks[i].mlp`` by an MoE block for every i in the section's moe_blocks."""
    section = check_section(section, len(blocks))
    for block, count, spec in zip(section["moe_blocks"], section["num_experts"], section["experts"]):
        layer = DynMoELayer(int(count), dim, spec, section["moe"])
        blocks[block].mlp = DynMoEBlock(layer, dropout)


def moe_layers(model: nn.Module) -> List[DynMoELayer]:
    return [m for m in model.modules() if isinstance(m, DynMoELayer)]


class DynMoELlamaForCausalLM(LlamaForCausalLM):
    config_class = DynMoELlamaConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoELlamaConfig):
        super().__init__(config)
        install_moe(self.model.layers, config.dynmoe, config.hidden_size)


class DynMoEQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = DynMoEQwen2Config
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEQwen2Config):
        super().__init__(config)
        install_moe(self.model.layers, config.dynmoe, config.hidden_size)


class DynMoEMistralForCausalLM(MistralForCausalLM):
    config_class = DynMoEMistralConfig
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEMistralConfig):
        super().__init__(config)
        install_moe(self.model.layers, config.dynmoe, config.hidden_size)


class DynMoEGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = DynMoEGPT2Config
    _can_compile_fullgraph = False  # the rows per expert are data dependent (nonzero)

    def __init__(self, config: DynMoEGPT2Config):
        super().__init__(config)
        # GPT2MLP applies dropout(resid_pdrop) to its output; the MoE block keeps it there.
        install_moe(self.transformer.h, config.dynmoe, config.hidden_size, config.resid_pdrop)
