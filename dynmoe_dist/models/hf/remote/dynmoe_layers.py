"""The MoE math of an exported DynMoE model, for plain transformers (``trust_remote_code=True``).

This file is copied verbatim into every exported directory and imports only torch: modeling_dynmoe.py
(upcycled dense bases) and modeling_dynmoe_moe.py (imported MoE families) build their MoE blocks from it,
computing what dynmoe_dist's training code computes (moe/routing.py, moe/experts.py, moe/layer.py):

  router    top-any (DynMoE): token t selects every expert e with sigmoid(cos(x_t, W_e)) > sigmoid(G_e);
            combine 'equal' (1/k) or 'softmax' (the softmax of the logits x_t . W_e over the chosen
            experts); a token selecting none gets its argmax expert with weight 1 (eval_k0 / train_k0
            'top1') or MoE output 0 ('skip' / 'zero'). top-k / top-p: softmax baselines. Gate math runs
            in at least float32, as in training.
  experts   'gated' ((act(x W_gate) * x W_in) W_out), 'ffn' (act(x W_in + b_in) W_out + b_out) or
            'gpt_oss' (gpt-oss's clamped SwiGLU with biases), nn.Linear's (out, in) weight layout
  combine   out_t = sum over selected e of weight_te * expert_e(x_t)
  blocks    the MoE layer as ``.moe`` in the place of the MLP, with what the base's block adds (BLOCKS):
            GPT-2's output dropout, a gated shared expert (Qwen2-MoE), always-on shared experts
            (DeepSeek-V3), the (hidden, router scores) pair (gpt-oss)

State-dict keys: ``<block>.mlp.moe.router.weight`` (E, D), ``<block>.mlp.moe.router.threshold`` (E,
top-any only), ``<block>.mlp.moe.experts.experts.<e>.w_in`` ...; shared experts keep the stock keys.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, R rows routed to one expert.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FORMATS = (2, 3)  # the dynmoe section formats this code reads (3 adds the imported MoE families)
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


def chosen_softmax(x_TD: Tensor, gate_ED: Tensor, mask_TE: Tensor) -> Tensor:
    """softmax of the logits x . W_e over each token's chosen experts (0 elsewhere, and for a token that
    chose none): a converted transformers router's probabilities renormalised over the top-any choice."""
    dtype = torch.promote_types(gate_dtype(x_TD), gate_dtype(gate_ED))
    logits_TE = x_TD.to(dtype) @ gate_ED.to(dtype).t()
    masked_TE = logits_TE.masked_fill(~mask_TE, float("-inf"))
    any_T1 = mask_TE.any(dim=-1, keepdim=True)
    # a row of only -inf would give NaN: tokens that chose none take a harmless row, then the mask zeroes it
    return torch.softmax(masked_TE.masked_fill(~any_T1, 0.0), dim=-1) * mask_TE


def top_any(
    x_TD: Tensor, gate_ED: Tensor, threshold_E: Tensor, k0_mode: str, combine: str = "equal"
) -> Tuple[Tensor, Tensor]:
    """(mask_TE, weights_TE). The 0/1 gate is a straight-through sign of relu(p - th), so a fine-tune
    still trains the router; tokens with k = 0 get the top-1 fallback (k0_mode 'top1') or nothing."""
    probs_TE = torch.sigmoid(cosine_scores(x_TD, gate_ED))
    mask_TE, gates_TE = threshold_gates(probs_TE, torch.sigmoid(threshold_E.to(probs_TE.dtype)))
    num_selected_T = mask_TE.sum(dim=-1)
    if combine == "softmax":
        chosen_TE = chosen_softmax(x_TD, gate_ED, mask_TE)
        weights_TE = chosen_TE if gates_TE is None else gates_TE * chosen_TE
    else:
        ones_TE = mask_TE.to(probs_TE.dtype) if gates_TE is None else gates_TE
        weights_TE = ones_TE / num_selected_T.clamp(min=1).unsqueeze(-1).to(ones_TE.dtype)
    if k0_mode == "top1":  # a scatter, not F.one_hot: that checks the indices' range with a host read
        best_TE = torch.zeros_like(mask_TE).scatter_(-1, probs_TE.detach().argmax(dim=-1, keepdim=True), True)
        fallback_TE = best_TE & (num_selected_T == 0).unsqueeze(-1)
        mask_TE, weights_TE = mask_TE | fallback_TE, weights_TE + fallback_TE.to(weights_TE.dtype)
    return mask_TE, weights_TE


def threshold_gates(probs_TE: Tensor, threshold_E: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """(mask_TE, gates_TE): p > th, and the straight-through gate r + (sign(r) - r).detach() of r = relu(p - th)
    when a gradient is wanted. Without one the gate is None: its value is the mask exactly (r + (1 - r) rounds
    to 1 for r in (0, 1), and p - th > 0 exactly when p > th), and generation skips its five operations."""
    if not (probs_TE.requires_grad or threshold_E.requires_grad):
        return probs_TE > threshold_E, None
    r_TE = F.relu(probs_TE - threshold_E)
    gates_TE = r_TE + (torch.sign(r_TE) - r_TE).detach()
    return gates_TE.detach() > 0, gates_TE


def top_k(logits_TE: Tensor, k: int, choice_bias_E: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Softmax, keep the k largest (of the probabilities plus the choice bias a run balanced by 'bias' left),
    renormalise the kept probabilities."""
    probs_TE = torch.softmax(logits_TE.to(gate_dtype(logits_TE)), dim=-1)
    choice_TE = probs_TE if choice_bias_E is None else probs_TE.detach() + choice_bias_E.to(probs_TE.dtype)
    index_TK = choice_TE.topk(k, dim=-1).indices
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

    choice_bias: Optional[Tensor]  # a buffer (None unless a top-k run balanced by 'bias')

    def __init__(self, num_experts: int, dim: int, options: Dict[str, Any]):
        super().__init__()
        self.options = options
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.threshold = nn.Parameter(torch.zeros(num_experts)) if options["router"] == "top_any" else None
        biased = options["router"] == "top_k" and options.get("balance", "off") == "bias"
        self.choice_bias: Optional[Tensor]
        self.register_buffer("choice_bias", torch.zeros(num_experts) if biased else None)

    def forward(self, x_TD: Tensor) -> Tuple[Tensor, Tensor]:
        if self.threshold is not None:
            k0_mode = self.options["train_k0"] if self.training else self.options["eval_k0"]
            # exports written before the combine option existed combined with 1/k
            combine = self.options.get("combine", "equal")
            return top_any(x_TD, self.weight, self.threshold, k0_mode, combine)
        dtype = torch.promote_types(gate_dtype(x_TD), self.weight.dtype)
        logits_TE = x_TD.to(dtype) @ self.weight.to(dtype).t()
        if self.options["router"] == "top_k":
            return top_k(logits_TE, int(self.options["top_k"]), cast(Optional[Tensor], self.choice_bias))
        return top_p(logits_TE, float(self.options["top_p"]))


def _bias(size: int, on: bool) -> Optional[nn.Parameter]:
    return nn.Parameter(torch.zeros(size)) if on else None


def _linear(rows: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    # Weights are cast to the rows' dtype per call, as in training (bf16 rows, fp32 weights).
    return F.linear(rows, weight.to(rows.dtype), None if bias is None else bias.to(rows.dtype))


def clamped_swiglu(gate_RF: Tensor, up_RF: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's gate: gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha gate)."""
    gate_RF = gate_RF.clamp(min=None, max=limit)
    up_RF = up_RF.clamp(min=-limit, max=limit)
    return (up_RF + 1) * (gate_RF * torch.sigmoid(gate_RF * alpha))


class DynMoEExpert(nn.Module):
    """One expert: 'gated' (w_out(act(w_gate x) * w_in x)), 'ffn' (w_out act(w_in x + b_in) + b_out) or
    'gpt_oss' (w_out clamped_swiglu(w_gate x + b_gate, w_in x + b_in) + b_out, biases always)."""

    def __init__(self, dim: int, spec: Dict[str, Any]):
        super().__init__()
        ffn_dim, kind = int(spec["ffn_dim"]), spec["expert_kind"]
        bias = kind == "gpt_oss" or bool(spec["expert_bias"])
        self.gated = kind in ("gated", "gpt_oss")
        self.act = ACTIVATIONS[spec["activation"]]
        # gpt-oss's clamp constants travel in the spec (its config's swiglu_alpha / swiglu_limit)
        self.swiglu = (float(spec["swiglu_alpha"]), float(spec["swiglu_limit"])) if kind == "gpt_oss" else None
        if self.gated:
            self.w_gate = nn.Parameter(torch.zeros(ffn_dim, dim))
        self.w_in = nn.Parameter(torch.zeros(ffn_dim, dim))
        self.w_out = nn.Parameter(torch.zeros(dim, ffn_dim))
        if self.gated:
            self.b_gate = _bias(ffn_dim, bias)
        self.b_in = _bias(ffn_dim, bias)
        self.b_out = _bias(dim, bias)

    def compute(self, rows_RD: Tensor, linear: Callable[[Tensor, str], Tensor]) -> Tensor:
        """The expert's math with ``linear(rows, 'in' / 'gate' / 'out')`` for its projections: this expert's
        own weights (forward) or every expert's at once over rows grouped by expert (DynMoEExperts.grouped)."""
        hidden_RF = linear(rows_RD, "in")
        if self.swiglu is not None:
            hidden_RF = clamped_swiglu(linear(rows_RD, "gate"), hidden_RF, *self.swiglu)
        elif self.gated:
            hidden_RF = self.act(linear(rows_RD, "gate")) * hidden_RF
        else:
            hidden_RF = self.act(hidden_RF)
        return linear(hidden_RF, "out")

    def forward(self, rows_RD: Tensor) -> Tensor:
        return self.compute(rows_RD, self.own_linear)

    def own_linear(self, rows: Tensor, name: str) -> Tensor:
        return _linear(rows, getattr(self, "w_" + name), getattr(self, "b_" + name))

    def weights(self) -> Dict[str, Tensor]:
        """{name: parameter} of the weights and biases it has."""
        return {name: p for name, p in self._parameters.items() if p is not None}


def routed_rows(mask_TE: Tensor, weights_TE: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(token_R, expert_R, weight_R, count_E): every (token, expert) pair the router chose, expert-major (an
    expert's rows contiguous, its tokens ascending: the order the per-expert loop combined them in)."""
    expert_R, token_R = mask_TE.t().nonzero(as_tuple=True)
    return token_R, expert_R, weights_TE[token_R, expert_R], mask_TE.sum(dim=0)


# torch's grouped matmul over rows sorted by group: F.grouped_mm from torch 2.10, torch._grouped_mm before
GROUPED_MM: Optional[Callable[..., Tensor]] = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # its kernels' dtypes (float64 loops)
_GROUPED_MM_RUNS: Dict[Tuple[str, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GROUPED_MM has a kernel for this device and dtype (none on CPU up to torch 2.8, none on older
    GPUs, float64 nowhere), tried once per device type and dtype on a tiny problem."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_RUNS:
        runs = GROUPED_MM is not None and dtype in GROUPED_DTYPES
        if runs:
            rows_RD, weight_EDF = (
                torch.ones(2, 8, device=device, dtype=dtype),
                torch.ones(2, 8, 8, device=device, dtype=dtype),
            )
            try:
                cast(Callable[..., Tensor], GROUPED_MM)(
                    rows_RD, weight_EDF, offs=torch.tensor([1, 2], dtype=torch.int32, device=device)
                )
            except (RuntimeError, NotImplementedError):
                runs = False
        _GROUPED_MM_RUNS[key] = runs
    return _GROUPED_MM_RUNS[key]


class DynMoEExperts(nn.Module):
    """Holds the experts as ``.experts`` (the state-dict keys of dynmoe_dist's ExpertBank) and runs them on
    the routed rows: one grouped matmul per projection over the rows sorted by expert when no gradient is
    wanted (generation), as transformers' fused experts do; otherwise (and in float64) a loop over the experts
    that has rows, which autograd trains; a single token (a batch-1 decode step) runs its experts directly."""

    def __init__(self, num_experts: int, dim: int, spec: Dict[str, Any]):
        super().__init__()
        self.experts = nn.ModuleList(DynMoEExpert(dim, spec) for _ in range(num_experts))
        self.row_sizes = (dim, int(spec["ffn_dim"]))  # D, F
        # {weight name: (E, ...)} for the grouped matmul, and the experts' parameter addresses it was built for
        self._stacked: Dict[str, Tensor] = {}
        self._stacked_at: Tuple[int, ...] = ()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to() / .half() give the parameters new storage: drop the stacked copy of the old one at once
        self._stacked, self._stacked_at = {}, ()
        return super()._apply(*args, **kwargs)

    def single_token(self, x_1D: Tensor, mask_1E: Tensor, weights_1E: Tensor) -> Tensor:
        """One token: its selected experts, indexed directly (one host read of the selection)."""
        out_1D = x_1D.new_zeros(x_1D.shape)
        for e in mask_1E[0].nonzero().flatten().tolist():
            out_1D = out_1D + self.experts[e](x_1D) * weights_1E[:, e : e + 1].to(x_1D.dtype)
        return out_1D

    def forward(self, x_TD: Tensor, mask_TE: Tensor, weights_TE: Tensor) -> Tensor:
        """out_t = sum over the experts e token t selected of weight_te * expert_e(x_t)."""
        token_R, expert_R, weight_R, count_E = routed_rows(mask_TE, weights_TE)
        rows_RD = x_TD.index_select(0, token_R)
        if self.groupable(rows_RD):
            rows_RD = self.grouped(rows_RD, expert_R, count_E)
        else:
            rows_RD = self.looped(rows_RD, count_E)
        weighted_RD = rows_RD * weight_R.to(rows_RD.dtype).unsqueeze(-1)
        return x_TD.new_zeros(x_TD.shape).index_add(0, token_R, weighted_RD)

    def groupable(self, rows_RD: Tensor) -> bool:
        """The grouped matmul: a dtype and row strides it has kernels for, rows to run, experts whose weights are
        here (not offloaded: accelerate's hooks bring them in only for each expert's own forward), and no
        gradient to give the experts."""
        if rows_RD.shape[0] == 0 or not grouped_mm_runs(rows_RD.device, rows_RD.dtype):
            return False
        if any(cast(DynMoEExpert, e).w_in.device != rows_RD.device for e in (self.experts[0], self.experts[-1])):
            return False
        # its kernels want every row stride a multiple of 16 bytes: D and F elements
        if any(n * rows_RD.element_size() % 16 for n in self.row_sizes):
            return False
        if not torch.is_grad_enabled():
            return True
        return not rows_RD.requires_grad and not any(p.requires_grad for p in self.experts.parameters())

    def looped(self, rows_RD: Tensor, count_E: Tensor) -> Tensor:
        """Each expert on its contiguous rows (one host read of the counts, not one per expert)."""
        chunks = rows_RD.split(count_E.tolist())
        return torch.cat([expert(rows) if rows.shape[0] else rows for expert, rows in zip(self.experts, chunks)])

    def grouped(self, rows_RD: Tensor, expert_R: Tensor, count_E: Tensor) -> Tensor:
        """Every expert at once: one grouped matmul per projection over the expert-sorted rows. Gate and in stay
        two matmuls: one over their concatenated weights (transformers' gate_up_proj) sums in another order in
        float32 and moved a trained model's logits 1.1e-6 from the run's (Mixtral, OLMoE, MiniMax-M2)."""
        stacked = self.stacked_weights()
        offsets_E = count_E.cumsum(0).to(torch.int32)

        def linear(rows: Tensor, name: str) -> Tensor:
            weight = stacked["w_" + name].to(rows.dtype)
            out = cast(Callable[..., Tensor], GROUPED_MM)(rows, weight.transpose(-2, -1), offs=offsets_E)
            bias = stacked.get("b_" + name)
            return out if bias is None else out + bias.to(rows.dtype).index_select(0, expert_R)

        return cast(DynMoEExpert, self.experts[0]).compute(rows_RD, linear)

    def addresses(self) -> Tuple[int, ...]:
        return tuple(p.data_ptr() for e in self.experts for p in cast(DynMoEExpert, e).weights().values())

    def stacked_weights(self) -> Dict[str, Tensor]:
        """{name: (E, ...)} of the experts' weights. Built on first use, then every expert's parameters are
        re-pointed into it (views, no second copy in memory; a save clones them apart); rebuilt when a
        parameter has moved (a load, .to(), a new expert)."""
        if self.addresses() != self._stacked_at:
            weights = [cast(DynMoEExpert, expert).weights() for expert in self.experts]
            with torch.no_grad():
                self._stacked = {name: torch.stack([named[name] for named in weights]) for name in weights[0]}
                for e, named in enumerate(weights):
                    for name, p in named.items():
                        p.data = self._stacked[name][e]
            self._stacked_at = self.addresses()
        return self._stacked


class DynMoELayer(nn.Module):
    """router -> every expert on the tokens that selected it -> weighted sum; x (..., D) -> (..., D)."""

    def __init__(self, num_experts: int, dim: int, spec: Dict[str, Any], options: Dict[str, Any]):
        super().__init__()
        self.router = DynMoERouter(num_experts, dim, options)
        self.experts = DynMoEExperts(num_experts, dim, spec)

    def run(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(output shaped like x, combine weights_TE)."""
        x_TD = x.reshape(-1, x.shape[-1])
        mask_TE, weights_TE = self.router(x_TD)
        if x_TD.shape[0] == 1:
            out_TD = self.experts.single_token(x_TD, mask_TE, weights_TE)
        else:
            out_TD = self.experts(x_TD, mask_TE, weights_TE)
        return out_TD.reshape(x.shape).to(x.dtype), weights_TE

    def forward(self, x: Tensor) -> Tensor:
        return self.run(x)[0]


class DynMoEBlock(nn.Module):
    """In the place of a block's MLP: the MoE layer as ``.moe``, then the MLP's own output dropout."""

    def __init__(self, moe: DynMoELayer, dropout: float = 0.0):
        super().__init__()
        self.moe = moe
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.moe(x))


class SharedExpertBlock(DynMoEBlock):
    """Routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x), the stock modules."""

    def __init__(self, moe: DynMoELayer, shared_expert: nn.Module, shared_expert_gate: nn.Module):
        super().__init__(moe)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class SharedExpertsBlock(DynMoEBlock):
    """Routed experts + the always-on shared experts (the stock MLP, n_shared_experts wide)."""

    def __init__(self, moe: DynMoELayer, shared_experts: nn.Module):
        super().__init__(moe)
        self.shared_experts = shared_experts

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(x) + self.shared_experts(x)


class RouterScoresBlock(DynMoEBlock):
    """Its decoder layer unpacks (hidden, router scores) from the MLP and drops the scores; the combine
    weights (T, E) stand in for them."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        return self.moe.run(x)


# The section's ``block`` (an imported family's: dynmoe_dist's models/hf/families/blocks.py, same names) ->
# (MoE layer, the stock sparse block it replaces) -> the module in its place
BLOCKS: Dict[str, Callable[[DynMoELayer, Any], nn.Module]] = {
    "routed": lambda layer, mlp: DynMoEBlock(layer),
    "shared_expert": lambda layer, mlp: SharedExpertBlock(layer, mlp.shared_expert, mlp.shared_expert_gate),
    "shared_experts": lambda layer, mlp: SharedExpertsBlock(layer, mlp.shared_experts),
    "router_scores": lambda layer, mlp: RouterScoresBlock(layer),
}


def check_section(section: Any, num_blocks: int) -> Dict[str, Any]:
    """The config's dynmoe section, or a one-line ValueError saying what is wrong with it."""
    if not isinstance(section, dict) or section.get("format") not in FORMATS:
        formats = " or ".join(map(str, FORMATS))
        raise ValueError(f"config.dynmoe must be a section of format {formats}, got {section!r:.80}")
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


MakeBlock = Callable[[DynMoELayer, nn.Module, int], nn.Module]
"""(MoE layer, the stock MLP it replaces, block index) -> the module in the MLP's place."""


def install_moe(blocks: nn.ModuleList, section: Dict[str, Any], dim: int, make_block: MakeBlock) -> None:
    """Replace ``blocks[i].mlp`` by ``make_block(layer, blocks[i].mlp, i)`` for every i in moe_blocks."""
    section = check_section(section, len(blocks))
    for block, count, spec in zip(section["moe_blocks"], section["num_experts"], section["experts"]):
        layer = DynMoELayer(int(count), dim, spec, section["moe"])
        blocks[block].mlp = make_block(layer, blocks[block].mlp, block)


def moe_layers(model: nn.Module) -> List[DynMoELayer]:
    return [m for m in model.modules() if isinstance(m, DynMoELayer)]
