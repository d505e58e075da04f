"""The lines a run says once, at its start, on rank 0: where its checkpoints go, a schedule changed by a
resume, an adaptive window the run never reaches. Pure text from the config and the step counts."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from .adaptive import WindowSchedule


def checkpoint_line(output_config) -> str:
    """'checkpoints: every 500 steps and every 30 min, and at the end or a stop (Ctrl-C, SIGTERM), into
    runs/x/checkpoints (the newest 2 kept); resume with --resume auto', or what turns them off."""
    out = output_config
    when = []
    if out.checkpoint_every:
        when.append(f"every {out.checkpoint_every} steps")
    if out.checkpoint_minutes:
        when.append(f"every {out.checkpoint_minutes:g} min")
    if out.final_checkpoint:
        when.append("at the end or a stop (Ctrl-C, SIGTERM)")
    if not when:
        return (
            "checkpoints: none (output.checkpoint_every = 0, output.checkpoint_minutes = 0, "
            "output.final_checkpoint = false): a stopped run cannot be resumed"
        )
    where = Path(out.out_dir) / "checkpoints"
    kept = f"the newest {out.keep_checkpoints} kept"
    return f"checkpoints: {' and '.join(when)}, into {where} ({kept}); resume with --resume auto"


def length_change_line(saved_train: Dict, train_config, saved_total: int, total: int, step: int) -> Optional[str]:
    """The one line for a resume whose train.max_steps / train.epochs differ from the checkpoint's run
    (None when the run's length is the same): the learning-rate schedule is a function of the total."""
    if saved_total == total:
        return None
    changed = [
        f"train.{key} {saved_train.get(key)!r} -> {getattr(train_config, key)!r}"
        for key in ("max_steps", "epochs")
        if saved_train.get(key) != getattr(train_config, key)
    ]
    return (
        f"resumed with another length ({', '.join(changed)}): the run now ends at step {total}, not "
        f"{saved_total}, and the learning rate from step {step} on follows a schedule of {total} steps "
        f"(warmup and decay), not the {saved_total} the checkpoint was trained with"
    )


def unreachable_window_line(window: WindowSchedule, total: int, by_epoch: bool) -> Optional[str]:
    """The one line for a run that ends before its first adaptive window does (None when it reaches it).
    ``by_epoch``: the window repeats every epoch (not every adaptive.period_steps)."""
    event = window.end  # the step (a count) after which the first window's event happens
    if event <= total:
        return None
    period = (
        f"one window per epoch of {window.period} steps"
        if by_epoch
        else f"one window every {window.period} steps (adaptive.period_steps)"
    )
    return (
        f"no expert is added, removed or moved: the first adaptive window ends at step {event}, after the "
        f"run's last step {total} ({period}); raise train.max_steps (or train.epochs) to at least {event}, "
        f"or set a shorter window period, e.g. adaptive.period_steps = {total}"
    )
