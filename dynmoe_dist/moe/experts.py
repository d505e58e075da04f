"""ExpertBank: the experts a process holds, computed over expert-contiguous rows.

Shape legend: R rows (routed pairs that arrived here), D model dim, F expert hidden dim,
e local experts (slots). ``counts_e`` says how many consecutive rows belong to each local slot.

Each expert is its own module with its own parameters, so that an expert can be removed, added or
moved between ranks together with *its own* optimizer state (Adam's step count included): a stacked
(E, D, F) parameter would force one shared step count on a freshly added expert. The grouped-matmul
path stacks the weights per call; that copy is small next to the matmuls it feeds.

Three expert kinds share the bank (``MoEConfig.expert_kind``): 'ffn' (``FeedForward``: act(x W_in) W_out,
BERT/GPT-2/ViT style), 'gated' (``GatedFeedForward``: (act(x W_gate) * x W_in) W_out, the
LLaMA/Qwen2/Mistral gate_proj/up_proj/down_proj block, also every fused-expert MoE family but gpt-oss) and
'gpt_oss' (``GptOssFeedForward``: gpt-oss's clamped SwiGLU with biases). Everything that moves or saves
experts goes through ``new_expert`` and ``expert_param_specs``, so migration, replication and checkpoints
handle all three. Under LoRA (``MoEConfig.adapter_rank``) every expert carries its adapters as its own
parameters (moe/adapters.py), so those paths carry them too.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..kernels.grouped_gemm import grouped_mm
from .adapters import add_adapters, grouped_side_deltas, has_adapters, plus, redraw_adapters, side_deltas
from .config import MoEConfig
from .frozen_base import linear_of, run_dtype, storage_tensors, store_expert, stored_weights
from .nf4 import holds_nf4

# 'gelu_tanh' is GPT-2's gelu_new / HF's gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
ACTIVATION_FNS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class FeedForward(nn.Module):
    """Two-layer feed-forward block with nn.Linear's weight layout (out_features, in_features).

    The same module is a dense transformer FFN and one expert, which is what makes upcycling a copy."""

    def __init__(self, dim: int, ffn_dim: int, *, bias: bool = True, activation: str = "gelu", init_std: float = 0.02):
        super().__init__()
        self.activation = activation
        self.w_in = nn.Parameter(torch.empty(ffn_dim, dim).normal_(0.0, init_std))
        self.w_out = nn.Parameter(torch.empty(dim, ffn_dim).normal_(0.0, init_std))
        self.b_in = nn.Parameter(torch.zeros(ffn_dim)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, rows_RD: Tensor) -> Tensor:
        (delta_RF,) = side_deltas(self, "in", rows_RD)
        hidden_RF = plus(linear_of(rows_RD, self.w_in, self.b_in), delta_RF)
        hidden_RF = ACTIVATION_FNS[self.activation](hidden_RF)
        return _linear_out(self, hidden_RF)


class GatedFeedForward(nn.Module):
    """Gated block (LLaMA's MLP): w_out (act(w_gate x) * (w_in x)); nn.Linear layout, optional biases.

    w_gate is gate_proj, w_in up_proj, w_out down_proj. The up projection keeps FeedForward's name so
    code reading ``w_in.shape`` for (F, D) works on both kinds."""

    def __init__(self, dim: int, ffn_dim: int, *, bias: bool = False, activation: str = "silu", init_std: float = 0.02):
        super().__init__()
        self.activation = activation
        self.w_gate = nn.Parameter(torch.empty(ffn_dim, dim).normal_(0.0, init_std))
        self.w_in = nn.Parameter(torch.empty(ffn_dim, dim).normal_(0.0, init_std))
        self.w_out = nn.Parameter(torch.empty(dim, ffn_dim).normal_(0.0, init_std))
        self.b_gate = nn.Parameter(torch.zeros(ffn_dim)) if bias else None
        self.b_in = nn.Parameter(torch.zeros(ffn_dim)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, rows_RD: Tensor) -> Tensor:
        gate_delta_RF, up_delta_RF = side_deltas(self, "in", rows_RD, parts=2)
        gate_RF = plus(linear_of(rows_RD, self.w_gate, self.b_gate), gate_delta_RF)
        up_RF = plus(linear_of(rows_RD, self.w_in, self.b_in), up_delta_RF)
        hidden_RF = ACTIVATION_FNS[self.activation](gate_RF) * up_RF
        return _linear_out(self, hidden_RF)


def clamped_swiglu(gate_RF: Tensor, up_RF: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's gate, in transformers' order (GptOssExperts._apply_gate): gate clamped above at limit, up
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate_RF = gate_RF.clamp(min=None, max=limit)
    up_RF = up_RF.clamp(min=-limit, max=limit)
    glu_RF = gate_RF * torch.sigmoid(gate_RF * alpha)
    return (up_RF + 1) * glu_RF


class GptOssFeedForward(nn.Module):
    """One gpt-oss expert: w_out clamped_swiglu(w_gate x + b_gate, w_in x + b_in) + b_out (nn.Linear layout).

    The checkpoint interleaves gate and up columns in one (D, 2F) matrix per expert (gate_up_proj[e][:, 0::2]
    is the gate); here they are GatedFeedForward's two (F, D) weights, so code reading ``w_in`` works on every
    kind (models/hf/families/ maps the layouts). Biases always: gpt-oss experts have them."""

    def __init__(self, dim: int, ffn_dim: int, *, alpha: float = 1.702, limit: float = 7.0, init_std: float = 0.02):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        # The sigmoid-gated linear unit: what upcycling or a report reads as this expert's activation.
        self.activation = "silu"
        self.w_gate = nn.Parameter(torch.empty(ffn_dim, dim).normal_(0.0, init_std))
        self.w_in = nn.Parameter(torch.empty(ffn_dim, dim).normal_(0.0, init_std))
        self.w_out = nn.Parameter(torch.empty(dim, ffn_dim).normal_(0.0, init_std))
        self.b_gate = nn.Parameter(torch.zeros(ffn_dim))
        self.b_in = nn.Parameter(torch.zeros(ffn_dim))
        self.b_out = nn.Parameter(torch.zeros(dim))

    def forward(self, rows_RD: Tensor) -> Tensor:
        gate_delta_RF, up_delta_RF = side_deltas(self, "in", rows_RD, parts=2)
        gate_RF = plus(linear_of(rows_RD, self.w_gate, self.b_gate), gate_delta_RF)
        up_RF = plus(linear_of(rows_RD, self.w_in, self.b_in), up_delta_RF)
        hidden_RF = clamped_swiglu(gate_RF, up_RF, self.alpha, self.limit)
        return _linear_out(self, hidden_RF)


Expert = Union[FeedForward, GatedFeedForward, GptOssFeedForward]
EXPERT_CLASSES: Dict[str, Union[Type[FeedForward], Type[GatedFeedForward], Type[GptOssFeedForward]]] = {
    "ffn": FeedForward,
    "gated": GatedFeedForward,
    "gpt_oss": GptOssFeedForward,
}


def _linear_out(expert: Expert, hidden_RF: Tensor) -> Tensor:
    """The output projection of any expert kind, its adapter's delta added."""
    (delta_RD,) = side_deltas(expert, "out", hidden_RF)
    return plus(linear_of(hidden_RF, expert.w_out, expert.b_out), delta_RD)


def new_expert(config: MoEConfig) -> Expert:
    """An expert of the config's kind; with ``adapter_rank`` its weights frozen and LoRA adapters beside them."""
    expert: Expert
    if config.expert_kind == "gpt_oss":
        expert = GptOssFeedForward(
            config.dim, config.ffn_dim, alpha=config.swiglu_alpha, limit=config.swiglu_limit, init_std=config.init_std
        )
    else:
        cls = FeedForward if config.expert_kind == "ffn" else GatedFeedForward
        expert = cls(
            config.dim, config.ffn_dim, bias=config.expert_bias, activation=config.activation, init_std=config.init_std
        )
    return with_config_adapters(expert, config)


def with_config_adapters(expert: Expert, config: MoEConfig) -> Expert:
    """``expert`` with the LoRA adapters ``config.adapter_rank`` asks for (its weights then frozen); as it is
    without."""
    if config.adapter_rank > 0:
        add_adapters(expert, config.adapter_rank, config.adapter_alpha, gated=config.expert_kind != "ffn")
    return expert


def autocast_rows(rows_RD: Tensor) -> Tensor:
    """Under autocast, routed rows travel and are computed in the autocast dtype (e.g. bf16); the
    weights stay fp32 masters and are cast per call."""
    device_type = rows_RD.device.type
    if torch.is_autocast_enabled(device_type):
        return rows_RD.to(torch.get_autocast_dtype(device_type))
    return rows_RD


def expert_param_specs(config: MoEConfig) -> List[Tuple[str, torch.Size]]:
    """(name, shape) of one expert's parameters, in parameters() order (built on the meta device)."""
    with torch.device("meta"):
        return [(name, p.shape) for name, p in new_expert(config).named_parameters()]


def expert_param_shapes(config: MoEConfig) -> List[torch.Size]:
    return [shape for _, shape in expert_param_specs(config)]


def added_expert_trains(config: MoEConfig) -> List[bool]:
    """Which of an expert's parameters (in ``parameters()`` order) train once an adaptive event adds it: its adapters
    under LoRA, every one with ``added_experts = 'trainable'`` or where the experts have no adapters."""
    with torch.device("meta"):
        return [p.requires_grad or config.added_experts == "trainable" for p in new_expert(config).parameters()]


def as_added(expert: Expert, config: MoEConfig, seed: int, copied_adapters: bool) -> Expert:
    """``expert`` (the combination of old experts an adaptive event formed, adapters included where
    ``copied_adapters``; else a seeded random one) made what ``config.added_experts`` says an added expert is: fresh
    adapters (A drawn from the event's ``seed``, B zero) for 'fresh_adapter' and wherever none were copied (zero A
    and B would never get a gradient), its own weights trainable for 'trainable'."""
    if has_adapters(expert):
        if config.added_experts == "fresh_adapter" or not copied_adapters:
            redraw_adapters(expert, seed)
        keep_trainability(expert, added_expert_trains(config))
    return expert


def keep_trainability(expert: nn.Module, trains: Sequence[bool]) -> None:
    """Each parameter of ``expert`` trains as ``trains`` says (in ``parameters()`` order): a rebuilt expert (moved,
    gathered, resumed) keeps what its original trained."""
    for p, flag in zip(expert.parameters(), trains, strict=True):
        p.requires_grad_(flag)


def expert_gradient_slots(config: MoEConfig) -> List[bool]:
    """Which of an expert's parameters (in parameters() order) may train: those a base expert trains (all of them,
    or only its adapters under LoRA) and those an added one does. A replicated expert's gradient sum has a slot
    for each (zeros where this expert does not train: parallel/grads.py), so every rank knows the layout."""
    with torch.device("meta"):
        params = list(new_expert(config).parameters())
    return [p.requires_grad or added for p, added in zip(params, added_expert_trains(config))]


def expert_with(params: Sequence[Tensor], config: MoEConfig) -> Expert:
    """An expert holding copies of ``params`` (in ``parameters()`` order) on their device, all in their run dtype
    (a stored weight widened, an NF4 one dequantised: moe/frozen_base.py)."""
    module = new_expert(config).to(device=params[0].device, dtype=run_dtype(params))
    with torch.no_grad():
        for p, value in zip(module.parameters(), params):
            p.copy_(value.to(p.dtype))
    return module


def stored_expert_with(params: Sequence[Tensor], config: MoEConfig) -> Expert:
    """``expert_with``, its frozen weights then stored as ``config.base_dtype`` says: an expert of a built run
    (re-placed, added, gathered, resumed)."""
    return cast(Expert, store_expert(expert_with(params, config), config.base_dtype))


def stored_new_expert(config: MoEConfig, like: Tensor) -> Expert:
    """A fresh expert on ``like``'s device and dtype, its frozen weights stored as ``config.base_dtype`` says."""
    return cast(Expert, store_expert(new_expert(config).to(device=like.device, dtype=like.dtype), config.base_dtype))


def copy_expert(expert: nn.Module, config: MoEConfig) -> Expert:
    """A copy of ``expert``, bit for bit, a stored weight held as it is (no deepcopy: torchao re-quantises an NF4
    weight's deepcopy with other scale blocks), each parameter as trainable as it was."""
    params = list(expert.parameters())
    with torch.random.fork_rng(devices=[]):  # the template's random draw must not move the run's generator
        module = stored_new_expert(config, torch.empty((), dtype=run_dtype(params), device=params[0].device))
    with torch.no_grad():
        for new, old in zip(module.parameters(), params):
            for into, value in zip(storage_tensors(new), storage_tensors(old)):
                into.copy_(value)
    keep_trainability(module, [p.requires_grad for p in params])
    return module


def stored_discarded(params: Sequence[Tensor], config: MoEConfig) -> List[Tensor]:
    """A discarded expert's parameters (in ``parameters()`` order, kept for adaptive.expert_init =
    'reuse_discarded'), its frozen weights stored as ``config.base_dtype`` says."""
    return stored_weights(params, [name for name, _ in expert_param_specs(config)], config.base_dtype)


def expert_from_named(named: Mapping[str, Tensor], config: MoEConfig, like: Tensor) -> Expert:
    """An expert from its parameters by name (a checkpoint's or an export's), on ``like``'s device and dtype, its
    frozen weights stored as ``config.base_dtype`` says."""
    return stored_expert_with(
        [named[n].to(device=like.device, dtype=like.dtype) for n, _ in expert_param_specs(config)], config
    )


def expert_key(layer_index: int, expert: int) -> str:
    """The one name of a logical expert outside a live model (checkpoints, exports): 'MoE layer/logical id'.
    Independent of ranks, ep size, slots and replicas."""
    return f"{layer_index}/{expert}"


def use_grouped_mm(mode: str, rows_RD: Tensor) -> bool:
    """'auto' picks torch._grouped_mm on CUDA in bf16, where it is a real fused kernel; on CPU a
    per-expert loop runs the same matmuls at the same speed without stacking the weights."""
    if mode == "grouped_mm":
        return True
    if mode == "loop":
        return False
    return rows_RD.is_cuda and rows_RD.dtype == torch.bfloat16


class ExpertBank(nn.Module):
    """The local experts of one MoE layer, in local-slot order."""

    def __init__(self, config: MoEConfig, experts: Iterable[Expert]):
        super().__init__()
        self.config = config
        self.experts = nn.ModuleList(experts)
        want = EXPERT_CLASSES[config.expert_kind]
        for expert in self.experts:
            if not isinstance(expert, want):
                raise ValueError(
                    f"expert_kind ({config.expert_kind!r}) needs {want.__name__} experts, got {type(expert).__name__}"
                )
            # The grouped path reads the clamp from the config, the per-expert loop from the expert.
            if isinstance(expert, GptOssFeedForward) and (expert.alpha, expert.limit) != (
                config.swiglu_alpha,
                config.swiglu_limit,
            ):
                raise ValueError(
                    f"gpt_oss expert with alpha, limit ({expert.alpha}, {expert.limit}) != swiglu_alpha, swiglu_limit "
                    f"({config.swiglu_alpha}, {config.swiglu_limit})"
                )
        # Sharded experts (FSDP over the expert-dp group) gather their weights inside their own forward:
        # every rank must then call every local expert every step, also on zero rows, or the ranks'
        # collectives stop lining up and hang. Set by dynmoe_dist.parallel.fsdp.
        self.run_every_expert = False

    @classmethod
    def fresh(cls, config: MoEConfig, num_experts: int) -> "ExpertBank":
        return cls(config, [new_expert(config) for _ in range(num_experts)])

    def __len__(self) -> int:
        return len(self.experts)

    def forward(self, rows_RD: Tensor, counts_e: Tensor, sizes_e: Optional[Sequence[int]] = None) -> Tensor:
        """``sizes_e``: the same counts as Python ints when the dispatcher has already read them
        (then the per-expert loop needs no host sync of its own)."""
        rows_RD = autocast_rows(rows_RD)
        if self.run_every_expert:
            return self._loop(rows_RD, counts_e, sizes_e)
        if len(self.experts) == 0 or rows_RD.shape[0] == 0:
            return 0.0 * rows_RD  # zeros that stay in the graph: the backward exchange must still run
        if use_grouped_mm(self.config.expert_compute, rows_RD) and not holds_nf4(self.experts):
            return self._grouped(rows_RD, counts_e)
        return self._loop(rows_RD, counts_e, sizes_e)

    def _loop(self, rows_RD: Tensor, counts_e: Tensor, sizes_e: Optional[Sequence[int]] = None) -> Tensor:
        # NOTE: device-to-host sync (segment sizes) unless the dispatcher passed them
        sizes = list(sizes_e) if sizes_e is not None else counts_e.tolist()
        segments = torch.split(rows_RD, sizes)
        outs = [expert(seg) for expert, seg in zip(self.experts, segments) if seg.shape[0] > 0 or self.run_every_expert]
        if not outs:
            return 0.0 * rows_RD  # zeros that stay in the graph: the backward exchange must still run
        return torch.cat(outs)

    def _grouped(self, rows_RD: Tensor, counts_e: Tensor) -> Tensor:
        offs_e = torch.cumsum(counts_e, 0).to(torch.int32)
        slot_R = torch.repeat_interleave(
            torch.arange(len(self.experts), device=rows_RD.device), counts_e, output_size=rows_RD.shape[0]
        )  # the size is known: no sync
        config = self.config  # one config for the whole bank
        act = ACTIVATION_FNS[config.activation]
        experts = list(self.experts)
        if config.expert_kind == "ffn":
            (delta_RF,) = grouped_side_deltas(experts, "in", rows_RD, offs_e)
            hidden_RF = act(plus(self._project(rows_RD, "w_in", "b_in", offs_e, slot_R), delta_RF))
        else:
            gate_delta_RF, up_delta_RF = grouped_side_deltas(experts, "in", rows_RD, offs_e, parts=2)
            up_RF = plus(self._project(rows_RD, "w_in", "b_in", offs_e, slot_R), up_delta_RF)
            gate_RF = plus(self._project(rows_RD, "w_gate", "b_gate", offs_e, slot_R), gate_delta_RF)
            if config.expert_kind == "gated":
                hidden_RF = act(gate_RF) * up_RF
            else:
                hidden_RF = clamped_swiglu(gate_RF, up_RF, config.swiglu_alpha, config.swiglu_limit)
        (delta_RD,) = grouped_side_deltas(experts, "out", hidden_RF, offs_e)
        return plus(self._project(hidden_RF, "w_out", "b_out", offs_e, slot_R), delta_RD)

    def _project(self, rows_RK: Tensor, weight: str, bias: str, offs_e: Tensor, slot_R: Tensor) -> Tensor:
        """rows @ W_e^T (+ b_e) for every segment, one grouped matmul over the stacked (e, K, N) weights."""
        dtype = rows_RK.dtype
        w_eKN = torch.stack([getattr(e, weight).t() for e in self.experts]).to(dtype)
        out_RN: Tensor = grouped_mm(rows_RK, w_eKN, offs_e)
        if self.config.expert_bias:
            out_RN = out_RN + torch.stack([getattr(e, bias) for e in self.experts]).to(dtype)[slot_R]
        return out_RN

    # -- growing and shrinking for real: absent experts cost no memory and no compute -------------
    def keep(self, local_slots: Sequence[int]) -> None:
        """Keep only the given slots, in that order (the others are freed)."""
        self.experts = nn.ModuleList(self.experts[i] for i in local_slots)

    def set_experts(self, experts: Sequence[nn.Module]) -> None:
        self.experts = nn.ModuleList(experts)


def reference_forward(experts: Sequence[Expert], rows_RD: Tensor, counts_e: Tensor) -> Tensor:
    """Plain per-row loop: row r goes through the expert whose segment holds it. Tests only."""
    slot_R = torch.repeat_interleave(torch.arange(len(experts)), counts_e.cpu())  # NOTE: device-to-host sync
    outs = [experts[int(s)](rows_RD[r : r + 1]) for r, s in enumerate(slot_R)]
    return torch.cat(outs) if outs else rows_RD.new_zeros(rows_RD.shape)
