"""Run telemetry: ``metrics.jsonl`` (the record of truth), TensorBoard scalars and the progress bar (progress.py).

Every record is a flat JSON object with a ``kind`` and the optimizer ``step`` it belongs to:

- ``step``: training scalars plus per-MoE-layer lists (``num_experts``, ``mean_k``, ``num_replicas``,
  ``blocks``: the model block each MoE layer sits in) and per-layer nested lists (``expert_load`` rows
  per expert, ``rank_load`` rows per EP rank);
- ``eval``: test scalars; ``event``: one adaptive change of one layer (``layer``: its position among
  the MoE layers, ``block``: the model's block index); ``final``: end-of-run scalars;
- ``resume``: the run resumed here from ``checkpoint``. The steps past it that the file already holds
  (run before a crash or stop, after that checkpoint) are run again; ``read_metrics`` keeps the later.

What a user reads (event lines, TensorBoard tags, the report) names a layer by its model block ("block
4"), as model.moe_layers does; records written before ``blocks`` existed are labelled by position.

Only rank 0 writes files; every other rank gets a ``Telemetry`` that does nothing, so the trainer
calls it unconditionally. The JSON lines file is flushed per line so that a crashed run keeps every
record it finished writing; the report (``report.py``) is drawn from that file alone.
"""

from __future__ import annotations

import json
import math
import os
from numbers import Integral, Real
from pathlib import Path
from typing import Any, Dict, List, Optional

from .progress import ProgressBar

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RECORD_KINDS = ("step", "eval", "event", "window", "final", "calibration", "resume")
PER_LAYER_LISTS = (
    "num_experts",
    "mean_k",
    "num_replicas",
    "expert_load",
    "rank_load",
    "blocks",
    "expert_utilization",
    "load_cv",
    "k_histogram",
    "threshold_shift",  # moe.target_k's move of the step (moe/balance.py)
    "threshold_drift",  # its integral term after the step
    "bias_spread",  # moe.balance = 'bias': max - min of the choice bias
)


# ----------------------------------------------------------------------------------------------------
# Records


def check_record(record: Dict[str, Any]) -> None:
    """Reject records the report could not place: wrong kind, no step, per-layer lists of other lengths."""
    kind = record.get("kind")
    if kind not in RECORD_KINDS:
        raise ValueError(f"record kind ({kind!r}) is not one of {RECORD_KINDS}")
    step = record.get("step")
    if not isinstance(step, Integral) or isinstance(step, bool) or step < 0:
        raise ValueError(f"record step ({step!r}) must be an int >= 0 (kind {kind!r})")
    if kind == "step":
        _check_layer_lists(record)


def _check_layer_lists(record: Dict[str, Any]) -> None:
    num_experts = record.get("num_experts", [])
    for field in PER_LAYER_LISTS:
        value = record.get(field)
        if value is not None and len(value) != len(num_experts):
            raise ValueError(
                f"step {record['step']}: len({field}) ({len(value)}) != number of MoE layers "
                f"({len(num_experts)}, from num_experts)"
            )
    for layer, loads in enumerate(record.get("expert_load") or []):
        if len(loads) != num_experts[layer]:
            raise ValueError(
                f"step {record['step']}: len(expert_load[{layer}]) ({len(loads)}) != "
                f"num_experts[{layer}] ({num_experts[layer]})"
            )


def _to_json(value: Any) -> Any:
    """json.dumps fallback: the trainer may hand over numpy or torch scalars and arrays.
    NOTE: device-to-host sync for a device tensor; the trainer hands over host values (read once per step)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON serialisable")


def plain_record(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record with numpy / torch values turned into Python numbers and lists (a JSON round trip:
    microseconds for a step record), so every sink sees exactly what metrics.jsonl will hold."""
    return json.loads(json.dumps(record, default=_to_json))


class MetricsWriter:
    """Appends records to ``out_dir/metrics.jsonl``, one flushed JSON line each.

    Opening an existing file (a resumed run) first cuts off a torn last line left by a crash, so the
    next record starts on a line of its own instead of gluing itself onto half a record.
    """

    def __init__(self, out_dir: str | os.PathLike):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(out_dir) / METRICS_FILE
        _drop_torn_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        check_record(record)
        # NaN / inf losses are written as NaN / Infinity (Python's json reads them back); a diverged run
        # must still be recorded rather than crash the logger.
        self._file.write(json.dumps(record, default=_to_json) + "\n")
        # Flush to the OS per line: a killed process loses nothing already written. No fsync per line
        # (it would cost a disk round trip every step); close() syncs once.
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as file:
        data = file.read()
        if data.endswith(b"\n"):
            return
        file.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """The records of a metrics file, in order, each step counted once (``latest_attempt``). A torn last
    line (a crash mid-write) is skipped; an unreadable line anywhere else means the file is damaged and
    raises ValueError."""
    return latest_attempt(read_metrics_lines(path))


def latest_attempt(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The run as it stands after its resumes: a resume from step S (a ``resume`` record) replaces what
    was recorded past S before it, and the ``final`` of a run it continues. Files written before resume
    records existed mark a resume only by a step record that does not come after the previous one: the
    records from its step on are replaced. The later record for a repeated step wins."""
    kept: List[Dict[str, Any]] = []
    last_step = -1  # of the newest step record kept
    for record in records:
        kind, step = record.get("kind"), record.get("step", 0)
        if kind == "resume":
            kept = [r for r in kept if r.get("step", 0) <= step and r.get("kind") != "final"]
            last_step = min(last_step, step)
        elif kind == "step":
            if step <= last_step:
                kept = [r for r in kept if r.get("step", 0) < step]
            last_step = step
        kept.append(record)
    return kept


def read_metrics_lines(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """Every record of a metrics file as written, repeats included."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write never finished
                break
            raise ValueError(f"{path}: line {number} is not JSON ({err.msg}): {line[:80]!r}") from err
    return records


# ----------------------------------------------------------------------------------------------------
# TensorBoard


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            "TensorBoard logging needs the 'tensorboard' package: pip install -e '.[report]' in the checkout "
            "(or turn it off: tensorboard = false in the run config, Telemetry(..., tensorboard=False))"
        ) from err
    return SummaryWriter


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def layer_names(record: Dict[str, Any]) -> List[str]:
    """'block{b}' for each MoE layer of a step record, by the model's block index; 'layer{i}' (the
    position) for records written before step records carried ``blocks``."""
    blocks = record.get("blocks")
    if blocks:
        return [f"block{b}" for b in blocks]
    return [f"layer{i}" for i in range(len(record.get("num_experts") or []))]


def event_layer_name(record: Dict[str, Any]) -> str:
    """'block{b}' of an event record ('layer{i}' for one written before events carried ``block``)."""
    return f"block{record['block']}" if "block" in record else f"layer{record.get('layer', 0)}"


def scalar_tags(record: Dict[str, Any]) -> Dict[str, float]:
    """TensorBoard tag -> value for every numeric scalar of a record.

    Step records: top-level numbers under ``train/``, per-layer lists under ``moe/block{b}/{field}``,
    and ``rank_load`` reduced to ``moe/block{b}/rank_load_max_over_mean`` (the load of the busiest EP
    rank over the mean: the straggler ratio that replication is meant to bring down).
    Eval / final records: ``eval/{field}`` / ``final/{field}``. Events: ``event/block{b}/{field}``.
    (``layer{i}`` instead of ``block{b}`` for records from before the block labels.)
    """
    kind = record["kind"]
    prefix = {"step": "train", "event": f"event/{event_layer_name(record)}"}.get(kind, kind)
    tags = {
        f"{prefix}/{field}": float(value)
        for field, value in record.items()
        if field not in ("step", "layer", "block") and _is_number(value)
    }
    if kind != "step":
        return tags  # per-layer lists exist only in step records (an event's `removed` is expert ids)
    names = layer_names(record)
    for field, values in record.items():
        if field != "blocks" and isinstance(values, list) and all(_is_number(v) for v in values):
            tags.update({f"moe/{_nth(names, i)}/{field}": float(v) for i, v in enumerate(values)})
    for layer, loads in enumerate(record.get("rank_load") or []):
        tags[f"moe/{_nth(names, layer)}/rank_load_max_over_mean"] = _max_over_mean(loads)
    return tags


def _nth(names: List[str], i: int) -> str:
    return names[i] if i < len(names) else f"layer{i}"  # a list that is not per MoE layer keeps positions


def _max_over_mean(values: List[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else math.nan


class TensorBoardWriter:
    """Scalars of step / eval / final records and the text of adaptive events, under
    ``out_dir/tensorboard``. Raises ImportError naming the 'report' extra if tensorboard is absent."""

    def __init__(self, out_dir: str | os.PathLike):
        self.log_dir = Path(out_dir) / TENSORBOARD_DIR
        self._writer = _summary_writer_class()(log_dir=str(self.log_dir))

    def write(self, record: Dict[str, Any]) -> None:
        step = record["step"]
        for tag, value in scalar_tags(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        if record["kind"] == "event":
            self._writer.add_text(f"events/{event_layer_name(record)}", describe_event(record), step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


# ----------------------------------------------------------------------------------------------------
# Console


def describe_event(record: Dict[str, Any]) -> str:
    """One line for an adaptive event, e.g. 'step 33 block 4: removed [3]; added 7 (reuse_discarded);
    2 moves; replicas {2: 2}; imbalance measured 1.80, planned 1.75 -> 1.10 by the moves; 8 experts'."""
    parts = []
    if record.get("removed"):
        parts.append(f"removed {list(record['removed'])}")
    if record.get("added"):
        added = ", ".join(f"{a.get('expert')} ({a.get('init', '?')})" for a in record["added"])
        parts.append(f"added {added}")
    if record.get("moves"):
        parts.append(f"{record['moves']} moves")
    if record.get("replicas"):
        parts.append("replicas {" + ", ".join(f"{e}: {n}" for e, n in record["replicas"].items()) + "}")
    imbalance = describe_imbalance(record)
    if imbalance:
        parts.append(imbalance)
    if "num_experts" in record:
        parts.append(f"{record['num_experts']} experts")
    body = "; ".join(parts) if parts else "no change"
    where = f"block {record['block']}" if "block" in record else f"layer {record.get('layer', '?')}"
    return f"step {record['step']} {where}: {body}"


def describe_imbalance(record: Dict[str, Any]) -> str:
    """'imbalance measured 1.10, planned 1.12 -> 1.04 by the moves': the window's max / mean rank load on
    the old placement, then the plan's estimate with nothing moved and (if experts move) after the moves.
    Events written before the unmoved estimate existed read 'imbalance 1.10 -> 1.04' (measured -> planned)."""
    measured, planned = record.get("imbalance_before"), record.get("imbalance_after")
    if measured is None or planned is None:
        return ""
    unmoved = record.get("imbalance_unmoved")
    if unmoved is None:
        return f"imbalance {measured:.2f} -> {planned:.2f}"
    text = f"imbalance measured {measured:.2f}, planned {unmoved:.2f}"
    return text + (f" -> {planned:.2f} by the moves" if record.get("moves") else "")


def describe_window(record: Dict[str, Any]) -> str:
    """'step 60 window: no token chose block 4 experts [3, 5]; block 5: every expert used'."""
    names = record.get("blocks") or list(range(len(record["dead_experts"])))
    parts = [
        f"block {name}: {'every expert used' if not dead else f'no token chose experts {dead}'}"
        for name, dead in zip(names, record["dead_experts"])
    ]
    return f"step {record['step']} window: " + "; ".join(parts)


def describe_scores(record: Dict[str, Any]) -> str:
    """'eval step 20: test_loss 1.1000, test_accuracy 0.6100' for eval and final records."""
    scores = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if _is_number(v) and k not in ("step", "epoch"))
    return f"{record['kind']} step {record['step']}: {scores}"


def progress_postfix(record: Dict[str, Any]) -> str:
    """'loss 1.230 acc 0.500 tok/s 1.2k k 2.00 experts 8/7'; fields the record lacks are left out."""
    parts = []
    if _is_number(record.get("loss")):
        parts.append(f"loss {record['loss']:.3f}")
    if _is_number(record.get("accuracy")):
        parts.append(f"acc {record['accuracy']:.3f}")
    if _is_number(record.get("tokens_per_s")):
        parts.append(f"tok/s {_short_number(record['tokens_per_s'])}")
    if record.get("mean_k"):
        parts.append(f"k {sum(record['mean_k']) / len(record['mean_k']):.2f}")
    if record.get("num_experts"):
        parts.append("experts " + "/".join(str(n) for n in record["num_experts"]))
    return " ".join(parts)


def _short_number(value: float) -> str:
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


# ----------------------------------------------------------------------------------------------------
# Facade


class Telemetry:
    """What the trainer calls: ``log(record)`` on every rank, ``close()`` at the end.

    On rank 0 a record goes to metrics.jsonl and TensorBoard; step records move the progress bar and
    event / window / eval / calibration records are printed above it. The final record is not printed:
    the end-of-run summary (train/cli.py ``summary``) says it, once. Elsewhere every call is a no-op.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        total_steps: int,
        rank0: bool,
        progress: bool = True,
        tensorboard: bool = True,
        initial_step: int = 0,
    ):
        self.rank0 = rank0
        # TensorBoard first: a missing package fails before any file is opened or bar drawn.
        self.tensorboard: Optional[TensorBoardWriter] = TensorBoardWriter(out_dir) if rank0 and tensorboard else None
        self.metrics: Optional[MetricsWriter] = MetricsWriter(out_dir) if rank0 else None
        self.progress = ProgressBar(total_steps, enabled=rank0 and progress, initial_step=initial_step)

    def log(self, record: Dict[str, Any]) -> None:
        if self.metrics is None:  # not rank 0
            return
        record = plain_record(record)
        self.metrics.write(record)  # validates the record before anything else sees it
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if record["kind"] == "step":
            self.progress.update(record["step"], progress_postfix(record))
        elif record["kind"] == "event":
            self.progress.write(describe_event(record))
        elif record["kind"] == "window":
            self.progress.write(describe_window(record))
        elif record["kind"] not in ("final", "resume"):  # the final scores are the caller's summary
            # (cli.summary), printed once; the resume is said at the start (train/run.py), bar or not
            self.progress.write(describe_scores(record))

    def close(self) -> None:
        self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> "Telemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
