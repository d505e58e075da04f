"""MoEConfig: everything one MoE feed-forward layer needs to know.

Validation happens in ``__post_init__`` so a bad value fails where it is written, with the
field name and the value in the message, before any tensor or collective exists.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union, get_args, get_origin

# How LoRA's frozen base is stored (moe/frozen_base.py): the run's dtype, bfloat16, or NF4 (QLoRA).
BASE_DTYPES = ("run", "bfloat16", "nf4")
ROUTERS = ("top_any", "top_k", "top_p", "native")
AUX_LOSSES = ("diverse", "simple", "load_balance", "efficiency", "switch", "entropy")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
EXPERT_KINDS = ("ffn", "gated", "gpt_oss")
TRAIN_K0_MODES = ("zero", "top1")
EVAL_K0_MODES = ("top1", "skip")
COMBINE_MODES = ("equal", "softmax")
EXPERT_COMPUTE = ("auto", "grouped_mm", "loop")
ADDED_EXPERTS = ("copy", "fresh_adapter", "trainable")  # under LoRA: what an expert an adaptive event adds is
BALANCE_RULES = ("off", "bias")

# The baselines' losses; a top-any layer takes its moe.preset's (default_aux_losses below).
DEFAULT_AUX = {
    "top_k": ("switch",),
    "top_p": ("switch",),
    # An imported transformers MoE keeps its own load-balance loss, which its checkpoint's config switches on
    # (output_router_logits, router_aux_loss_coef: moe.routing.NativeRule.aux_loss_coef); none of ours on top.
    "native": (),
}

# Named sets of DynMoE settings ('section.key' -> value), applied by the run-config loader to every such
# option the user did not set (dynmoe_dist.config.with_preset), and only under the top-any router: a
# preset describes DynMoE, and the top-k / top-p baselines keep their own defaults.
#   paper     the authors' released code (the ICLR revision's DeepSpeed variant, docs/algorithm.md): four
#             losses, top-1 fallback at evaluation, recycled experts, an expert added whenever any token
#             of the window selected none
#   paper-v1  the first paper version: the same, with L_div + L_simple only
#   project   this project's default, chosen by the comparison in docs/results.md: the first version's
#             two losses. With L_lb on, k collapses (30-80 % of the training tokens select no expert);
#             without it DynMoE ended above the best top-k. The reference growth rule stays: capping growth
#             (adaptive.min_unrouted_share = 0.01) cost 0.9 points for 1-3 fewer experts per layer.
_PAPER = {
    "moe.aux_losses": ("diverse", "simple", "load_balance", "efficiency"),
    "moe.aux_loss_weight": 0.01,
    "moe.train_k0": "zero",
    "moe.eval_k0": "top1",
    "moe.threshold_init": 0.0,
    "adaptive.expert_init": "reuse_discarded",
    "adaptive.max_adds_per_event": 1,
    "adaptive.min_unrouted_share": 0.0,
}
PRESETS = {
    "paper": _PAPER,
    "paper-v1": {**_PAPER, "moe.aux_losses": ("diverse", "simple")},
    "project": {**_PAPER, "moe.aux_losses": ("diverse", "simple")},
}
DEFAULT_PRESET = "project"

# Fields only some routers read (the rest of the layer reads all the others): field -> those routers.
# Setting one under another router does nothing; the trainer warns about it at start-up.
ROUTER_FIELDS = {
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "threshold_init": ("top_any",),
    "train_k0": ("top_any",),  # only top-any lets a token select no expert
    "eval_k0": ("top_any",),
    "combine": ("top_any",),
    "calibrate_k": ("top_any",),
    "calibrate_samples": ("top_any",),
    "target_k": ("top_any",),
    "preset": ("top_any",),
}


def default_aux_losses(router: str, preset: str) -> Tuple[str, ...]:
    """The losses a layer gets when none are named: a top-any layer its preset's (so a bare MoEConfig
    agrees with a run config), the baselines their router's."""
    if router == "top_any" and preset in PRESETS:
        losses = PRESETS[preset]["moe.aux_losses"]
        assert isinstance(losses, tuple), "every preset names its losses as a tuple"
        return losses
    return DEFAULT_AUX.get(router, ())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# -- value types of config fields ------------------------------------------------------------------
# Generic, for every config dataclass of the project (dynmoe_dist.config checks each TOML value with
# them); here because moe is the lowest layer, so every config module may import them.
# Handles int, float (ints too), str, bool, Optional[X], List[X], Tuple[X, ...] and Tuple[X, Y].

# Optional[X] and X | None have different origins
_UNIONS = (Union, types.UnionType)

# scalar type -> (one value, several values), for messages like "must be a list of integers"
_KINDS = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    bool: ("true or false", "booleans"),
}


def _scalar_ok(value: Any, kind: type) -> bool:
    # bool is an int subclass: `true` is no integer, and 1 is no boolean.
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def conforms(value: Any, annotation: Any) -> bool:
    """Whether a TOML value fits a field annotation (of the kinds listed above)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _UNIONS:
        return value is None or any(conforms(value, a) for a in args if a is not type(None))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and Ellipsis not in args:
            return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
        return all(conforms(v, args[0]) for v in value)
    if annotation not in _KINDS:  # a new field type: teach conforms() and describe() about it
        raise TypeError(f"config fields of type {annotation!r} are not supported by conforms()")
    return _scalar_ok(value, annotation)


def describe(annotation: Any) -> str:
    """'an integer', 'a list of strings', 'a list of 2 numbers', ... for the error message."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _UNIONS:
        return describe(next(a for a in args if a is not type(None)))
    if origin is tuple and Ellipsis not in args:
        return f"a list of {len(args)} {_KINDS[args[0]][1]}"
    if origin in (list, tuple):
        return f"a list of {_KINDS[args[0]][1]}"
    return _KINDS[annotation][0]


@dataclass
class MoEConfig:
    """One MoE layer. Defaults follow the DynMoE authors' shipped settings."""

    dim: int = 64
    """Model (hidden) dimension D of the tokens entering the layer."""
    ffn_dim: int = 256
    """Hidden dimension F of each expert's two-layer feed-forward block."""
    num_experts: int = 8
    """Number of experts the layer starts with (DynMoE then adds and removes experts)."""
    max_experts: Optional[int] = None
    """Upper bound on experts during adaptive training; None means num_experts * 2."""
    min_experts: int = 1
    """Lower bound on experts; removals never go below it."""
    router: str = "top_any"
    """Routing rule: 'top_any' (DynMoE), 'top_k' (GShard/Switch), 'top_p' (Huang et al.) or 'native' (an imported
    transformers MoE checkpoint's own rule, read from its config: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
    gpt-oss)."""
    top_k: int = 2
    """k for the top_k router."""
    top_p: float = 0.4
    """Probability mass p for the top_p router (the crossing expert is kept)."""
    aux_loss_weight: float = 0.01
    """Weight of the summed auxiliary losses of this layer."""
    aux_losses: Optional[Tuple[str, ...]] = None
    """Auxiliary losses that are on; None means the default: top-any takes its preset's, the others DEFAULT_AUX."""
    activation: str = "gelu"
    """Expert activation: 'gelu' (erf), 'gelu_tanh' (GPT-2's gelu_new), 'relu' or 'silu'. Upcycling takes
    it from the dense block."""
    expert_kind: str = "ffn"
    """Expert block: 'ffn' (act(x W_in) W_out), 'gated' (LLaMA/Qwen2/Mistral: (act(x W_gate) * x W_in) W_out) or
    'gpt_oss' (gpt-oss's clamped SwiGLU with biases). Upcycling and MoE imports take it from the model."""
    expert_bias: bool = True
    """Whether expert linear layers carry biases (True matches BERT-style dense blocks)."""
    train_k0: str = "zero"
    """Training, token with k = 0: 'zero' (MoE output 0, rides the residual; the reference) or 'top1'."""
    eval_k0: str = "top1"
    """Evaluation, token with k = 0: 'top1' (argmax fallback; the reference) or 'skip' (output 0)."""
    calibrate_k: int = 0
    """Top-any converted from an imported MoE (model.path a Mixtral, Qwen-MoE, ...): per-expert thresholds
    are calibrated on a sample of the training data so that the mean experts per token starts at this k
    (0 = the model's own k), each expert keeping its share of the model's own routing."""
    calibrate_samples: int = 32
    """Training sequences (the first of the first epoch's order, over all ranks) the calibration routes."""
    combine: str = "equal"
    """Top-any combine weights: 'equal' (1/k over the k chosen experts: DynMoE) or 'softmax' (softmax of the
    router logits x . W_e over the chosen experts: for a router converted from a transformers MoE, its own
    probabilities renormalised over what top-any chose)."""
    expert_compute: str = "auto"
    """Expert matmuls: 'grouped_mm' (torch._grouped_mm), 'loop' (one matmul per expert) or 'auto'."""
    init_std: float = 0.02
    """Std of the normal init of freshly created expert weights."""
    threshold_init: float = 0.0
    """Initial gate threshold G of top-any routers (the reference: 0). Higher values start sparser:
    a token then selects expert e only if cos(x, W_e) > G_e."""
    swiglu_alpha: float = 1.702
    """gpt_oss experts: the alpha of glu = gate * sigmoid(alpha * gate); taken from the checkpoint's config."""
    swiglu_limit: float = 7.0
    """gpt_oss experts: gate is clamped above at limit, up to [-limit, limit]; taken from the checkpoint's config."""
    adapter_rank: int = 0
    """LoRA: the rank r of one adapter per projection of every routed expert (A (r, in), B (out, r); the
    expert's own weights frozen); 0 = no adapters. Set from the [lora] section (models/lora.py), not here."""
    adapter_alpha: float = 0.0
    """LoRA: the adapters' alpha (their output is scaled by alpha / rank). Set from the [lora] section."""
    base_dtype: str = "run"
    """LoRA: how every expert's frozen weights are stored: 'run' (the run's dtype), 'bfloat16' or 'nf4'
    (moe/frozen_base.py); new, moved and rebuilt experts are stored so too. Set from the [lora] section."""
    added_experts: str = "copy"
    """LoRA: what an expert an adaptive event adds is ('copy', 'fresh_adapter' or 'trainable': the [lora] section's
    added_experts, models/lora.py; moe/experts.py ``as_added``). Set from the [lora] section."""
    target_k: float = 0.0
    """Top-any compute budget: the mean experts per token (all tokens of all ranks) that a controller holds
    each layer at, by moving every threshold of the layer together after each step, out of the gradient
    (moe/balance.py). 0 = no budget (k follows the thresholds' training). A converted model's calibration
    starts at it; an expert an adaptive event adds starts at its share of it. It counts training tokens: at
    evaluation a token that chose none takes the top-1 fallback unless eval_k0 = 'skip'."""
    balance: str = "off"
    """Load balance without an aux loss: 'off', or 'bias' (DeepSeek-V3's rule: after each step every expert's
    choice bias moves by balance_rate against its load, re-centred so the biases' mean stays; a choice-only
    bias for top_k, the checkpoint's e_score_correction_bias for a native DeepSeek-V3, mean-zero moves of
    the thresholds for top_any, so that the mean k stays with target_k)."""
    balance_rate: float = 0.001
    """Step of the 'bias' balance rule (DeepSeek-V3's gamma), in score units (threshold units for top_any)."""
    preset: str = DEFAULT_PRESET
    """Named DynMoE settings for every moe / adaptive option you do not set yourself (top-any runs only):
    'paper' (the authors' released code: 4 aux losses, top-1 eval fallback, reuse_discarded init),
    'paper-v1' (the same with the original diverse + simple losses only) or 'project' (this project's
    choice, from the comparison in docs/results.md: today the same as 'paper-v1'). See PRESETS in
    dynmoe_dist/moe/config.py for every value."""

    def __post_init__(self) -> None:
        if self.max_experts is None:
            self.max_experts = self.num_experts * 2
        if self.aux_losses is None:
            self.aux_losses = default_aux_losses(self.router, self.preset)
        self.aux_losses = tuple(self.aux_losses)
        self.validate()

    def validate(self) -> None:
        _require(self.dim >= 1, f"dim ({self.dim}) must be >= 1")
        _require(self.ffn_dim >= 1, f"ffn_dim ({self.ffn_dim}) must be >= 1")
        _require(self.num_experts >= 1, f"num_experts ({self.num_experts}) must be >= 1")
        _require(self.min_experts >= 1, f"min_experts ({self.min_experts}) must be >= 1")
        assert self.max_experts is not None and self.aux_losses is not None, "filled in above"
        _require(
            self.max_experts >= self.num_experts,
            f"max_experts ({self.max_experts}) < num_experts ({self.num_experts})",
        )
        _require(
            self.min_experts <= self.num_experts,
            f"min_experts ({self.min_experts}) > num_experts ({self.num_experts})",
        )
        _require(self.router in ROUTERS, f"router ({self.router!r}) must be one of {ROUTERS}")
        _require(self.preset in PRESETS, f"preset ({self.preset!r}) must be one of {tuple(PRESETS)}")
        if self.router == "top_k":
            _require(
                1 <= self.top_k <= self.num_experts,
                f"top_k ({self.top_k}) must be in [1, num_experts ({self.num_experts})]",
            )
        _require(0.0 < self.top_p <= 1.0, f"top_p ({self.top_p}) must be in (0, 1]")
        _require(self.aux_loss_weight >= 0, f"aux_loss_weight ({self.aux_loss_weight}) must be >= 0")
        for name in self.aux_losses:
            _require(name in AUX_LOSSES, f"aux_losses entry ({name!r}) must be one of {AUX_LOSSES}")
        # top-any scores are independent sigmoids, not a distribution: their "entropy" means nothing.
        if self.router == "top_any" and "entropy" in (self.aux_losses or ()):
            raise ValueError(
                f"aux_losses entry ('entropy') needs a softmax router (top_k or top_p), router is {self.router!r}"
            )
        _require(self.activation in ACTIVATIONS, f"activation ({self.activation!r}) must be one of {ACTIVATIONS}")
        _require(self.expert_kind in EXPERT_KINDS, f"expert_kind ({self.expert_kind!r}) must be one of {EXPERT_KINDS}")
        # gpt-oss experts always carry biases: the grouped path adds them only when expert_bias says so.
        _require(
            self.expert_kind != "gpt_oss" or self.expert_bias,
            f"expert_kind ('gpt_oss') needs expert_bias true (gpt-oss experts carry biases), got {self.expert_bias}",
        )
        _require(self.train_k0 in TRAIN_K0_MODES, f"train_k0 ({self.train_k0!r}) must be one of {TRAIN_K0_MODES}")
        _require(self.eval_k0 in EVAL_K0_MODES, f"eval_k0 ({self.eval_k0!r}) must be one of {EVAL_K0_MODES}")
        _require(self.calibrate_k >= 0, f"calibrate_k ({self.calibrate_k}) must be >= 0")
        _require(self.calibrate_samples >= 1, f"calibrate_samples ({self.calibrate_samples}) must be >= 1")
        self.validate_budget()
        _require(self.adapter_rank >= 0, f"adapter_rank ({self.adapter_rank}) must be >= 0")
        _require(
            self.adapter_rank == 0 or self.adapter_alpha > 0,
            f"adapter_alpha ({self.adapter_alpha}) must be > 0 with adapter_rank {self.adapter_rank}",
        )
        _require(self.base_dtype in BASE_DTYPES, f"base_dtype ({self.base_dtype!r}) must be one of {BASE_DTYPES}")
        _require(
            self.added_experts in ADDED_EXPERTS,
            f"added_experts ({self.added_experts!r}) must be one of {ADDED_EXPERTS}",
        )
        _require(self.combine in COMBINE_MODES, f"combine ({self.combine!r}) must be one of {COMBINE_MODES}")
        _require(
            self.expert_compute in EXPERT_COMPUTE,
            f"expert_compute ({self.expert_compute!r}) must be one of {EXPERT_COMPUTE}",
        )

    def validate_budget(self) -> None:
        """The compute budget and the balance rule: a k the layer can reach, a router whose choice can be biased,
        and one starting k (a converted model's calibration starts at the budget)."""
        _require(
            0.0 <= self.target_k <= self.num_experts,
            f"target_k ({self.target_k}) must be in (0, num_experts ({self.num_experts})], or 0 for no budget",
        )
        _require(
            not (0 < self.target_k < 1 and self.train_k0 == "top1"),
            f"target_k ({self.target_k}) < 1 cannot be met with train_k0 ('top1'): every token runs an expert",
        )
        _require(self.balance in BALANCE_RULES, f"balance ({self.balance!r}) must be one of {BALANCE_RULES}")
        _require(self.balance_rate > 0, f"balance_rate ({self.balance_rate}) must be > 0")
        _require(
            self.balance != "bias" or self.router != "top_p",
            "balance ('bias') needs choice scores to bias (top_any, top_k, or a native family with a correction "
            "bias such as DeepSeek-V3); router 'top_p' chooses by probability mass",
        )
        _require(
            not (self.target_k and self.calibrate_k) or float(self.calibrate_k) == self.target_k,
            f"calibrate_k ({self.calibrate_k}) != target_k ({self.target_k}): calibration starts at the budget; "
            "set one of them",
        )
