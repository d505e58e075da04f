"""torchrun, in-process: start the local workers with torch's elastic launcher and say which failed.

``torch.distributed.run`` as a command turns any failed worker into a ChildFailedError traceback of some
40 lines ending in PyTorch's docs link, and its agent logs every failure and every worker it stops at
ERROR / WARNING level. The launcher (train/launch.py) prints one line of its own instead, so this keeps
the agent's messages that say something to a user (restarts of the worker group) and returns the
failures as data.

SIGINT / SIGTERM (Ctrl-C, a preempted job) reach the launcher only: torch starts each worker in a
session of its own. The agent's own handling would kill the workers (after 30 s at most); instead
``StopForwarding`` hands the first signal on to every worker, which finishes its step and leaves after a
checkpoint (train/control.py); a worker still starting finds it announced when it registers. A second
signal kills the workers at once, through the agent (its SignalException, with SIGKILL: no traceback from
any worker).
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, Iterator, List, Optional, Tuple

# The agent's loggers whose failure messages repeat what the launcher says itself: "failed (exitcode: 2)
# local_rank: 0 ...", "Sending process N closing signal SIGTERM".
NOISY_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)
# Its "Received SIGKILL death signal, shutting down workers" repeats the launcher's hard-stop line; its
# restart messages are worth keeping, so only that one is filtered (DeathSignalFilter).
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


class DeathSignalFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.getMessage()


@contextmanager
def quiet_failure_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    agent, death_signals = logging.getLogger(AGENT_LOGGER), DeathSignalFilter()
    agent.addFilter(death_signals)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        agent.removeFilter(death_signals)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The signals torch's agent handles itself (torchrun --signals-to-handle): the stop signals are ours.
AGENT_SIGNALS = ("--signals-to-handle", "SIGHUP,SIGQUIT")


class StopForwarding:
    """The launcher's SIGINT / SIGTERM handler while the workers run. ``worker_pids()`` lists the
    workers that have registered; ``announce(signum)`` tells those that register later."""

    def __init__(self, worker_pids: Callable[[], List[int]], announce: Callable[[int], None]):
        self.worker_pids, self.announce = worker_pids, announce
        self.signum = 0
        """The first stop signal (0: none came)."""
        self.hard = False
        """Whether a second signal killed the workers."""

    def __call__(self, signum: int, frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.signum:
            self.hard = True
            raise SignalException(f"stopped by signal {signum}", sigval=signal.SIGKILL)
        self.signum = signum
        # Announced before the workers are listed: a worker registers, then looks for the announcement,
        # so each one either is listed here or finds it (or both: it counts a signal once).
        self.announce(signum)
        for pid in self.worker_pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # already gone
                pass

    @contextmanager
    def installed(self) -> Iterator[None]:
        saved = {sig: signal.signal(sig, self) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def run_local_workers(torchrun_args: List[str], stop: Optional[StopForwarding] = None) -> Dict[int, int]:
    """``torchrun *torchrun_args`` in this process: {} when every worker ended well (or ``stop`` killed
    them: its ``hard``), else {global rank: exit code} of the workers that failed (after any restarts
    torchrun was allowed), the cause first (cause_first: the agent stops the other ranks with a signal,
    and the failures' timestamps are whole seconds)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torch leaves parse_args and run untyped
    args = parse_args([*AGENT_SIGNALS, *torchrun_args] if stop else torchrun_args)  # type: ignore[no-untyped-call]
    try:
        with quiet_failure_logs(), stop.installed() if stop else nullcontext():
            run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        return cause_first({rank: (f.exitcode, f.timestamp) for rank, f in err.failures.items()})
    except SignalException:
        if stop is None or not stop.hard:
            raise
    return {}


def cause_first(failures: Dict[int, Tuple[int, int]]) -> Dict[int, int]:
    """{rank: (exit code, timestamp)} -> {rank: exit code}, the rank most likely to have caused the others'
    end first: an exit on its own before an end by a signal, then the earliest, then the lowest rank."""
    order = sorted(failures, key=lambda rank: (failures[rank][0] < 0, failures[rank][1], rank))
    return {rank: failures[rank][0] for rank in order}
