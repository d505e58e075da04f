"""What a run decides at each step boundary, the same on every rank: write a checkpoint now, stop now.

Each rank votes before a step and the votes ride in that step's one summed all-reduce (the trainer's
metrics vector), so every rank reads the same sums after the step and acts on them together: no extra
collective, nothing that could hang. Two votes:

- **checkpoint due by time**: only rank 0 looks at its clock (``output.checkpoint_minutes``); the steps
  rule (``output.checkpoint_every``) needs no vote, the step count is the same everywhere;
- **stop**: any rank that got SIGINT or SIGTERM (Ctrl-C; a preempted job; the launcher forwards the
  signal it gets to every rank) asks; the run stops after the step, writing a checkpoint first.

A second signal is a hard stop: the rank exits at once, without a checkpoint. A signal that reaches a
rank twice within ``SAME_SIGNAL_S`` (sent to the whole process group and also forwarded by the
launcher) counts once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SAME_SIGNAL_S = 1.0


def stop_exit_status(signum: int) -> int:
    """The shell's status for a process ended by this signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class StopSignals:
    """SIGINT / SIGTERM handlers for one rank: the first asks for a clean stop, a second one stops hard.
    ``installed()`` only installs them in the main thread; elsewhere (a Ray worker's thread) the run
    never stops early."""

    def __init__(self) -> None:
        self.signum = 0
        self._at = 0.0

    @contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        saved = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if not self.signum:
            self.ask(signum)
        elif time.monotonic() - self._at > SAME_SIGNAL_S:
            os._exit(stop_exit_status(self.signum))  # the user insists: no checkpoint, no cleanup

    def ask(self, signum: int) -> None:
        """A stop, as the first signal asks it (also from the launcher's announcement)."""
        if not self.signum:
            self.signum, self._at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum != 0


@dataclass
class Decision:
    """What every rank does after a step, from the summed votes."""

    checkpoint: bool
    stop: bool


class StepControl:
    """The votes before a step and the decision after it (``output.checkpoint_every`` /
    ``checkpoint_minutes``, a stop signal)."""

    def __init__(self, output_config, is_rank0: bool, signals: Optional[StopSignals] = None, saved_step: int = -1):
        self.every = output_config.checkpoint_every
        self.seconds = output_config.checkpoint_minutes * 60.0
        self.is_rank0 = is_rank0
        self.signals = signals or StopSignals()
        self.last_save = time.monotonic()
        self.last_saved_step = saved_step
        """The step of the newest checkpoint of this run (-1: none; a resumed run's: its checkpoint's)."""

    def votes(self) -> List[float]:
        """[stop asked, checkpoint due by time]: summed over ranks by the step's all-reduce."""
        due = bool(self.is_rank0 and self.seconds and time.monotonic() - self.last_save >= self.seconds)
        return [float(self.signals.requested), float(due)]

    def decide(self, summed: Sequence[float], step: int) -> Decision:
        stop, due = summed[0] > 0, summed[1] > 0
        return Decision(checkpoint=due or bool(self.every and step % self.every == 0), stop=stop)

    def saved(self, step: int) -> None:
        self.last_save, self.last_saved_step = time.monotonic(), step

    @property
    def signum(self) -> int:
        return self.signals.signum
