"""Progress on the console, rank 0 only: the bar over a run's optimizer steps (ProgressBar) and a bar over
any other wait of more than a few seconds (WaitBar: calibration, held-out scoring, export).

On a terminal a bar is redrawn in place; in a log file (Ray job logs, nohup) every redraw is a line of its
own, so it is redrawn at most every LOG_FILE_REDRAW_S there.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class LogLines:
    """A stream for tqdm in a log: each redraw (tqdm's '\r' + bar) becomes one line, blank redraws (its
    clearing before a message) are dropped."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


# Seconds between redraws: in place on a terminal; in a log file (Ray job logs, nohup) every redraw is
# a line of its own (LogLines), so only every 30 s there.
TERMINAL_REDRAW_S, LOG_FILE_REDRAW_S = 0.1, 30.0
WAIT_SHOWN_AFTER_S = 2.0
"""A wait bar appears only once its wait has lasted this long: a wait of a second needs no bar."""


def _tqdm(total: int, unit: str, **options: Any):
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    redraw_s = TERMINAL_REDRAW_S if interactive else LOG_FILE_REDRAW_S
    stream = sys.stderr if interactive else LogLines(sys.stderr)
    return tqdm(total=total, unit=unit, dynamic_ncols=True, mininterval=redraw_s, file=stream, **options)


class ProgressBar:
    """A tqdm bar over optimizer steps; ``enabled=False`` (ranks other than 0) prints nothing at all.

    The bar closes the moment it reaches its last step, so the finished bar is drawn once, with the
    training rate, before the final evaluation (which has its own WaitBar) starts."""

    def __init__(self, total_steps: int, enabled: bool = True, initial_step: int = 0):
        if total_steps < 0:
            raise ValueError(f"total_steps ({total_steps}) must be >= 0")
        self.enabled = enabled
        self._bar = _tqdm(total_steps, "step", initial=initial_step) if enabled else None

    def update(self, step: int, postfix: str) -> None:
        """Move the bar to ``step`` (records may come every log_every steps) and show ``postfix`` (its scores)."""
        if self._bar is None:
            return
        # The postfix first, without a redraw of its own: the update redraws at most once per redraw
        # interval (a forced redraw per record would append a line per step to a log file).
        self._bar.set_postfix_str(postfix, refresh=False)
        # `step` counts optimizer steps done; clamp so a miscounted last step never overruns the bar.
        self._bar.update(max(0, min(step, self._bar.total) - self._bar.n))
        if self._bar.n >= self._bar.total:
            self.close()

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)
        elif self.enabled:
            print(message, flush=True)  # the finished bar is closed; lines after it print plainly

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class WaitBar:
    """A bar over a wait that is not a training step (calibrating layers, scoring held-out batches,
    writing an export), so that no minute passes on a silent screen. ``enabled=False`` (ranks other than
    0, output.progress = false) prints nothing. It appears after WAIT_SHOWN_AFTER_S; a finished bar is
    cleared from a terminal and stays in a log file, where it says how long the wait took."""

    def __init__(self, description: str, total: int, unit: str, enabled: bool = True):
        self._bar = None
        if enabled:
            leave = not sys.stderr.isatty()
            self._bar = _tqdm(total, unit, desc=description, leave=leave, delay=WAIT_SHOWN_AFTER_S)

    def advance(self, count: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "WaitBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
