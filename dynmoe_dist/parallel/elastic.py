"""torchrun, in-process: start the local workers with torch's elastic launcher and say which failed.

``torch.distributed.run`` as a command turns any failed worker into a ChildFailedError traceback of some
40 lines ending in PyTorch's docs link, and its agent logs every failure and every worker it stops at
ERROR / WARNING level. The launcher (train/launch.py) prints one line of its own instead, so this keeps
the agent's messages that say something to a user (restarts of the worker group) and returns the
failures as data.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

# The agent's loggers whose failure messages repeat what the launcher says itself: "failed (exitcode: 2)
# local_rank: 0 ...", "Sending process N closing signal SIGTERM".
NOISY_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)


@contextmanager
def quiet_failure_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def run_local_workers(torchrun_args: List[str]) -> Dict[int, int]:
    """``torchrun *torchrun_args`` in this process: {} when every worker ended well, else
    {global rank: exit code} of the workers that failed (after any restarts torchrun was allowed), the
    cause first (cause_first: the agent stops the other ranks with a signal, and the failures' timestamps
    are whole seconds)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(torchrun_args)  # type: ignore[no-untyped-call]  # torch leaves these two untyped
    try:
        with quiet_failure_logs():
            run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        return cause_first({rank: (f.exitcode, f.timestamp) for rank, f in err.failures.items()})
    return {}


def cause_first(failures: Dict[int, Tuple[int, int]]) -> Dict[int, int]:
    """{rank: (exit code, timestamp)} -> {rank: exit code}, the rank most likely to have caused the others'
    end first: an exit on its own before an end by a signal, then the earliest, then the lowest rank."""
    order = sorted(failures, key=lambda rank: (failures[rank][0] < 0, failures[rank][1], rank))
    return {rank: failures[rank][0] for rank in order}
