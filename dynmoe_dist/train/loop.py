"""The training loop, readable top to bottom: build -> parallelize -> steps (-> adapt) -> evaluate.

World-size invariance: every rank builds the full model from the same seed, takes its contiguous
share of each deterministic global micro-batch, divides its summed loss by the item count of the
*global* micro-batch, and gradients are summed. The same config and seed therefore give the same
per-step loss on any number of ranks and any ep size (up to floating-point summation order).
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Sequence

import torch

from ..config import RunConfig
from ..models.build import build_model
from ..models.lora import expert_config
from ..moe.balance import Balancers
from ..moe.layer import MoELayer
from ..parallel.groups import ParallelGroups, current_world_size, sum_over_ranks
from ..planning.packing import rank_loads as rank_loads_of
from ..tasks import build_task
from .checkpoint import CheckpointManager, Part
from .checkpoint_base import FrozenBase
from .checkpoint_parts import weight_parts
from .data import BatchSchedule, eval_ranges, shard
from .model_files import ModelFiles
from .optim import set_lr
from .parts import DTYPES, TrainParts, build_parts
from .progress import WaitBar
from .recorder import K_BINS, Recorders, health
from .step import MicroBatch, StepTotals, evaluate_totals, train_step

# What a step record holds per MoE layer (lists in layer order; telemetry checks their lengths).
LAYER_METRICS = (
    "num_experts",
    "mean_k",
    "expert_load",
    "rank_load",
    "num_replicas",
    "expert_utilization",
    "load_cv",
    "k_histogram",
)


class Trainer:
    """The task, the batch schedule, the parts that train the model (``TrainParts``), the recorders, and
    the step: one optimizer step at a time, evaluation, and the loop's own checkpointed state."""

    def __init__(self, config: RunConfig):
        self.config = config
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        world_size = current_world_size()
        # Everything checkable without communication is checked before the first collective.
        self.task = build_task(config.task)
        self.schedule = BatchSchedule(
            self.task.size("train"),
            config.train.global_batch_size,
            config.train.grad_accum,
            config.train.epochs,
            config.train.max_steps,
            config.train.seed,
        )
        self.schedule.check_world(world_size)
        self.eval_ranges = eval_ranges(self.task.size("test"), config.train.global_batch_size, world_size)
        torch.manual_seed(config.train.seed)
        self.source = build_model(config.model, expert_config(config.moe, config.lora), self.task.model_needs())
        self.parts: TrainParts = build_parts(config, self.source)
        self.recorders = Recorders(self.parts.experts.layers, self.parts.groups)
        # moe.target_k / moe.balance: out-of-gradient moves of the routers' choice, after each step
        self.balancers = Balancers.for_layers(self.parts.experts.layers, config.moe)
        self.step = 0

    # -- read-only views of the parts --------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.parts.model

    @property
    def groups(self) -> ParallelGroups:
        return self.parts.groups

    @property
    def moe_layers(self) -> List[MoELayer]:
        return self.parts.experts.layers

    @property
    def world_size(self) -> int:
        return self.parts.groups.world_size

    @property
    def is_rank0(self) -> bool:
        return self.parts.groups.rank == 0

    def frozen_base(self) -> FrozenBase:
        """The base's experts and how this run stores them: what a resume rebuilds the experts' frozen weights from."""
        return FrozenBase(self.source.base_expert, self.config.lora.base_dtype)

    def checkpoint_manager(self, adaptive=None) -> CheckpointManager:
        """The run's checkpoints: this loop, the expert set, the dense state, the recorders and, with
        adaptive experts on, the controller, as named parts."""
        parts = self.parts
        states: Dict[str, Part] = {
            "trainer": self,
            # a LoRA run's checkpoints hold what trains; the frozen base is rebuilt from model.path
            **weight_parts(parts, self.frozen_base() if self.config.lora.enabled else None),
            "recorders": self.recorders,
            "model": ModelFiles(self.source, self.config, parts.groups),
        }
        if self.balancers is not None:
            states["balance"] = self.balancers
        if adaptive is not None:
            states["adaptive"] = adaptive
        return CheckpointManager(self.config, parts.groups, states)

    # -- one optimizer step ------------------------------------------------------------------------
    def autocast(self):
        if self.config.train.precision == "bf16":
            return torch.autocast(self.groups.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def local_batch(self, split: str, indices: torch.Tensor):
        batch = self.task.batch(split, shard(indices, self.groups.rank, self.world_size)).to(self.groups.device)
        dtype = DTYPES[self.config.train.precision]
        batch.inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.inputs.items()}
        return batch

    def micro_batch(self, indices: torch.Tensor) -> MicroBatch:
        """This rank's share of the global training micro-batch ``indices``."""
        batch = self.local_batch("train", indices)
        return MicroBatch(batch.inputs, batch.targets, self.task.count_items("train", indices))

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The step's micro-batches, each read only when the step reaches it."""
        for micro in range(self.config.train.grad_accum):
            yield self.micro_batch(self.schedule.micro_indices(self.step, micro))

    def train_step(self, votes: Sequence[float] = ()) -> Dict:
        """One optimizer step; ``votes`` (train/control.py), if any, are summed over ranks with the step's
        metrics and come back, summed, under the record's "votes" (the caller takes them out)."""
        started = time.perf_counter()
        self.recorders.reset_step()
        if self.balancers is not None:
            self.balancers.start_step()
        totals = StepTotals(self.groups.device)
        lr = set_lr(self.parts.optimizer, self.step, self.config.train, self.schedule.total_steps)
        train = self.config.train
        grad_norm = train_step(
            self.parts,
            self.micro_batches(),
            self.task.loss_terms,
            train.grad_accum,
            totals,
            train.grad_clip,
            self.autocast,
        )
        self.step += 1
        record = self._step_record(totals, time.perf_counter() - started, lr, votes)
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        return record

    # -- metrics -----------------------------------------------------------------------------------
    def _sum_over_ranks(self, vector: torch.Tensor, what: str) -> torch.Tensor:
        return sum_over_ranks(vector, self.groups, what)

    def _step_record(self, totals: StepTotals, seconds: float, lr: float, votes: Sequence[float]) -> Dict:
        balance = [self.balancers.step_vector()] if self.balancers is not None else []
        local = torch.cat([totals.vector(), self.recorders.step_vector(), *balance])
        summed = self._sum_over_ranks(
            torch.cat([local, torch.tensor(votes, dtype=local.dtype)]), "step metrics all_reduce"
        ).tolist()
        summed, summed_votes = summed[: local.numel()], summed[local.numel() :]
        if self.balancers is not None:  # their counts ride at the end of the step's one summed vector
            balance_moves = self.balancers.update(summed[len(summed) - self.balancers.size :])
            summed = summed[: len(summed) - self.balancers.size]
        task_loss, correct, items, aux = summed[:4]
        record = {
            "kind": "step",
            "step": self.step,
            "epoch": self.step / self.schedule.steps_per_epoch,
            "loss": task_loss + aux,
            "task_loss": task_loss,
            "aux_loss": aux,
            "accuracy": correct / max(items, 1),
            "lr": lr,
            "step_s": seconds,
            "samples_per_s": items / seconds,
        }
        if votes:
            record["votes"] = summed_votes
        record.update(self._layer_metrics(summed[4:], seconds, items))
        if self.balancers is not None:
            record.update(balance_moves, target_k=self.config.moe.target_k)
        return record

    def _layer_metrics(self, flat: List[float], seconds: float, items: float) -> Dict:
        """Per MoE layer, from the recorders' summed step vectors (tokens, k sum, counts, k histogram)."""
        per_layer: Dict[str, List] = {key: [] for key in LAYER_METRICS}
        offset, tokens = 0, items
        for index, shard_ in enumerate(self.parts.experts.shards):
            e = shard_.layer.num_experts
            layer_tokens, k_sum = flat[offset], flat[offset + 1]
            counts, k_hist = flat[offset + 2 : offset + 2 + e], flat[offset + 2 + e : offset + 2 + e + K_BINS]
            offset += 2 + e + K_BINS
            tokens = layer_tokens if index == 0 else tokens
            layer_health = health(counts, layer_tokens)
            for key, value in (
                ("num_experts", e),
                ("mean_k", k_sum / max(layer_tokens, 1)),
                ("expert_load", [int(c) for c in counts]),
                ("rank_load", rank_loads_of(shard_.placement, counts)),
                ("num_replicas", shard_.placement.num_slots - e),
                ("expert_utilization", layer_health["utilization"]),
                ("load_cv", layer_health["load_cv"]),
                ("k_histogram", [int(c) for c in k_hist]),
            ):
                per_layer[key].append(value)
        return {"tokens_per_s": tokens / seconds, **per_layer}

    # -- checkpointed state ------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        """The loop's own state: the step, the RNG, and where the data stream stands."""
        state = {"step": self.step, "rng": torch.get_rng_state(), "data": self.schedule.position(self.step)}
        if self.groups.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.groups.device)
        return state

    def load_state_dict(self, state: Dict) -> None:
        self.step = self.schedule.check_position(state["data"]) if "data" in state else int(state["step"])
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.groups.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.groups.device)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, wait: str = "held-out scoring") -> Dict:
        """Loss and accuracy on the whole test split, sharded over ranks like training batches; rank 0
        shows a bar over the batches, named ``wait``."""
        size = self.task.size("test")
        shown = self.is_rank0 and self.config.output.progress
        with WaitBar(wait, len(self.eval_ranges), "batch", enabled=shown) as bar:
            summed = evaluate_totals(self.parts, self._eval_batches(bar), self.task.loss_terms, self.autocast)
        items = self.task.count_items("test", torch.arange(size))
        return {"test_loss": float(summed[0]) / items, "test_accuracy": float(summed[1]) / size}

    def _eval_batches(self, bar: WaitBar) -> Iterator:
        """This rank's share of each held-out batch, read when the evaluation reaches it."""
        for start, end in self.eval_ranges:
            yield self.local_batch("test", torch.arange(start, end))
            bar.advance()
