"""Measurement helpers shared by the benchmarks: interleaved wall-clock timing, peak resident memory
of one step in a fresh process, and a description of the machine.

Why interleaved: the benchmark machines are small and shared, so load drifts during a run. Timing the
cases round-robin (A, B, C, A, B, C, ...) exposes every case to the same drift, and the minimum over
repeats is the figure least disturbed by other processes.

Why a fresh process for memory: torch's CPU allocations go straight to malloc, invisible to
tracemalloc, and glibc keeps freed memory mapped, so an earlier case would inflate a later one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

Step = Callable[[], object]  # what it returns is not read

MEMORY_METHOD = (
    "each case runs in a fresh Python process with MALLOC_MMAP_THRESHOLD_=131072: warm up the same "
    "code at a tiny size (library and autograd initialisation), build the real weights and inputs, "
    "return freed heap to the OS (malloc_trim), read VmRSS as the baseline, reset the high-water mark "
    "(write 5 to /proc/self/clear_refs), run one forward+backward, and report VmHWM - baseline in MiB. "
    "torch CPU tensors come from malloc and are invisible to tracemalloc; resident memory sees them. "
    "The fixed mmap threshold stops glibc from raising it after large frees, so every tensor above "
    "128 KiB is its own mapping and the peak counts live tensors, not heap fragmentation left by "
    "whatever ran before (without it the same case varied by about 15 MiB from run to run)."
)
# A fixed threshold also turns off glibc's dynamic threshold adjustment (see mallopt(3)).
MEMORY_PROCESS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def tensors_mib(tensors: Iterable[torch.Tensor]) -> float:
    """MiB of the tensors' parts held on this rank (a DTensor's local shard)."""
    from ..parallel.fsdp import local

    return sum(local(t).numel() * t.element_size() for t in tensors) / 2**20


def optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The optimizer's state tensors of ``params`` (Adam's moments; not its step counters)."""
    return [v for p in params for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v) and k != "step"]


class GradientsAtStep:
    """MiB of the gradients of named parameter lists, read just before every optimizer step: the training
    step frees the gradients right after it (train/step.py), so this is when they are held."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, Sequence[torch.Tensor]]):
        self.params = params
        self.mib = {name: 0.0 for name in params}
        optimizer.register_step_pre_hook(self._read)

    def _read(self, *_) -> None:
        for name, params in self.params.items():
            self.mib[name] = tensors_mib(p.grad for p in params if p.grad is not None)


def state_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer, gradients: GradientsAtStep) -> float:
    """Parameters + gradients (at the optimizer step) + optimizer state this rank holds, MiB."""
    params = list(model.parameters())
    held = tensors_mib(params) + sum(gradients.mib.values()) + tensors_mib(optimizer_state(optimizer, params))
    return round(held, 2)


def next_token_step(parts, tokens_BW: torch.Tensor, input_name: str = "input_ids") -> Callable[[], object]:
    """The trainer's step (train/step.py) on this rank's token windows (B, L + 1), as a causal-LM run makes
    it: inputs the first L tokens (the forward's keyword ``input_name``: transformers' ``input_ids``, the
    built-in CausalLM's ``tokens_BL``), targets the last L, the loss divided by the global target count
    (every rank holds as many windows). The returned step gives its ``StepTotals`` (this rank's loss share)."""
    from ..tasks.causal_lm import next_token_terms
    from ..train.step import MicroBatch, StepTotals, train_step

    targets_BL = tokens_BW[:, 1:]
    batch = MicroBatch({input_name: tokens_BW[:, :-1]}, targets_BL, targets_BL.numel() * parts.groups.world_size)

    def step() -> StepTotals:
        totals = StepTotals(parts.groups.device)
        train_step(parts, [batch], next_token_terms, 1, totals)
        return totals

    return step


def time_interleaved(steps: Dict[str, Step], *, repeats: int, warmup: int) -> Dict[str, dict]:
    """Wall-clock milliseconds of each step, min and median over ``repeats`` round-robin rounds.

    ``warmup`` rounds run first and are discarded: the first calls of a step pay for page faults
    of fresh allocations and library initialisation, which steady-state training does not."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: summarize_ms(ms) for name, ms in samples.items()}


def summarize_ms(samples_ms: List[float]) -> dict:
    return {
        "ms_min": round(min(samples_ms), 2),
        "ms_median": round(statistics.median(samples_ms), 2),
        "repeats": len(samples_ms),
    }


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    assert match is not None, f"{field} missing from /proc/self/status"
    return int(match.group(1))


def memory_supported() -> bool:
    return sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)


def peak_rss_above_baseline_mb(step: Step) -> float:
    """Run ``step`` once and return (peak resident memory - resident memory before it) in MiB."""
    baseline_kib = _status_kib("VmRSS")
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0), so the peak is this step's alone.
    Path("/proc/self/clear_refs").write_text("5")
    step()
    return round((_status_kib("VmHWM") - baseline_kib) / 1024, 2)


def trim_heap() -> None:
    """Hand freed heap back to the OS so a baseline is what is live (glibc only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measured_call(fn: Step) -> Tuple[float, float]:
    """(peak MiB above the resident memory before, seconds) of one call of ``fn``, after gc and a heap trim;
    the peak is NaN where the high-water mark cannot be reset (not Linux)."""
    gc.collect()
    trim_heap()
    seconds: List[float] = []

    def timed() -> None:
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)

    if memory_supported():
        peak = peak_rss_above_baseline_mb(timed)
    else:
        timed()
        peak = float("nan")
    return peak, seconds[0]


@contextlib.contextmanager
def memory_process_env() -> Iterator[None]:
    """MEMORY_PROCESS_ENV in this process's environment while processes are spawned (they inherit it, and
    glibc reads the mmap threshold at start-up), restored afterwards."""
    saved = {k: os.environ.get(k) for k in MEMORY_PROCESS_ENV}
    os.environ.update(MEMORY_PROCESS_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_in_fresh_process(
    entry: str, spec: dict, *, extra_env: Optional[Dict[str, str]] = None, timeout_s: float = 900
) -> dict:
    """Call ``entry`` ('package.module:function') with ``spec`` in a new interpreter; the function
    prints one JSON object on its last stdout line, which is returned."""
    module, function = entry.split(":")
    code = f"import sys, json; from {module} import {function}; {function}(json.loads(sys.argv[1]))"
    env = {**os.environ, **(extra_env or {})}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"{entry} failed ({done.returncode}) for {spec}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def available_memory_mb() -> Optional[float]:
    try:
        return _meminfo_kib("MemAvailable") / 1024
    except (OSError, AssertionError):
        return None


def _meminfo_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), flags=re.MULTILINE)
    assert match is not None, f"{field} missing from /proc/meminfo"
    return int(match.group(1))


def machine_info(threads: int) -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # glibc's allocator settings change a CPU run's resident peak (what it keeps of freed blocks), not its tensors
        "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},
    }


def _cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), flags=re.MULTILINE)
    except OSError:
        match = None
    return match.group(1).strip() if match else platform.processor()


def emit_json(result: dict, out: Optional[str]) -> None:
    """Print a benchmark's JSON and, with --out, also write it there (parent folders made first: a
    missing runs/ must not lose a run that took minutes)."""
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
