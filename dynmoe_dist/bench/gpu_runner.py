"""The runner of the GPU check's sections (bench/gpu.py): each section in its own try-block under its own
time cap and all of them under one total budget, recorded as pass / fail / skip with the error text, so
one failure never loses the rest. The sections themselves are bench/gpu_sections.py; nothing here
imports them (no import circle: gpu.py -> gpu_sections.py -> this module).
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Sequence

TOTAL_BUDGET_S = 340.0
STATUSES = ("pass", "fail", "skip")
ERROR_CHARS = 3000


class Skip(Exception):
    """Raised by a section that cannot run here; the message is the recorded reason."""


class SectionTimeout(Exception):
    pass


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[dict], dict]
    """Takes the shared context, returns the section's figures; ``passed: False`` in them marks a fail."""
    cap_s: float
    needs_cuda: bool = True
    what: str = ""

    def __post_init__(self) -> None:
        # Sections name their function directly (a missing one fails the import); this catches a None or a
        # name passed by mistake instead of the function itself.
        if not callable(self.run):
            raise TypeError(f"section {self.name!r}: run ({self.run!r}) is not a function")


@contextmanager
def time_limit(seconds: float):
    """Raise SectionTimeout in the main thread after ``seconds`` (SIGALRM; a no-op off the main thread).
    A CUDA kernel in flight finishes first: the alarm interrupts Python code, not the device."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout(f"exceeded its time cap of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:  # an outer alarm (e.g. pytest-timeout's) keeps its remaining time
            remaining = max(outer_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def run_section(section: Section, context: dict, deadline: float) -> dict:
    record = {"name": section.name, "what": section.what, "cap_s": section.cap_s}
    started = time.monotonic()
    cap = min(section.cap_s, deadline - started)
    try:
        if section.needs_cuda and not context.get("cuda") and not context.get("rehearsal"):
            raise Skip("no CUDA")
        if cap < 1.0:
            raise Skip("the total time budget of the check is spent")
        with time_limit(cap):
            result = section.run(context)
        record["result"] = result
        record["status"] = "fail" if result.get("passed") is False else "pass"
    except Skip as skip:
        record.update(status="skip", reason=str(skip))
    except SectionTimeout as timeout:
        record.update(status="fail", error=f"{section.name} {timeout}")
    except Exception:  # the point of the runner: record it and go on with the next section
        record.update(status="fail", error=traceback.format_exc()[-ERROR_CHARS:])
    finally:
        _release_device(context)
    record["seconds"] = round(time.monotonic() - started, 2)
    return record


def _release_device(context: dict) -> None:
    if context.get("device") != "cuda":
        return
    try:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as error:  # a broken context fails the next section, which records it
        context.setdefault("device_errors", []).append(repr(error))


def run_sections(sections: Sequence[Section], context: dict, budget_s: float = TOTAL_BUDGET_S) -> List[dict]:
    deadline = time.monotonic() + budget_s
    return [run_section(section, context, deadline) for section in sections]
