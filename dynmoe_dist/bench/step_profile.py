"""Where a training step's time goes, for bench hf-moe's --profile: torch.profiler over a few steps, read as
milliseconds per step of
  the step's phases   the ``phase: NAME`` record_function blocks the benchmark's step opens (forward,
                      backward, grad_sync, optimizer);
  the MoE blocks'     forward only, from module hooks: ``moe: routing`` (the router), ``moe: experts`` (the
  parts               expert matmuls) and ``moe: block`` (the whole block; the rest of it is dispatch and
                      combine: permutation, all-to-all, weighting). Backward has no module boundaries, so
                      its share shows in the operators: ``_AllToAllBackward``, ``MmBackward0``, ...;
  the operators       the busiest, by self CPU time. A collective's time includes waiting for the other
                      rank, i.e. load imbalance.
The same blocks are found in ours (``MoELayer`` with ``router`` and ``experts``) and in transformers'
(``*SparseMoeBlock`` with ``gate`` and ``experts``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List

import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

PHASES = ("forward", "backward", "grad_sync", "optimizer")
MOE_PARTS = ("routing", "experts", "block")


def moe_parts(model: nn.Module) -> Dict[str, List[nn.Module]]:
    """The MoE blocks of ours (MoELayer) or transformers' model (*SparseMoeBlock), their routers and expert banks."""
    parts: Dict[str, List[nn.Module]] = {part: [] for part in MOE_PARTS}
    for module in model.modules():
        if type(module).__name__ == "MoELayer" or type(module).__name__.endswith("SparseMoeBlock"):
            children = dict(module.named_children())
            parts["block"].append(module)
            parts["routing"].append(children.get("router") or children["gate"])
            parts["experts"].append(children["experts"])
    return parts


@contextlib.contextmanager
def labelled(model: nn.Module) -> Iterator[None]:
    """Every MoE block, router and expert bank's forward inside ``record_function("moe: PART")``."""
    handles = []
    for part, modules in moe_parts(model).items():
        for module in modules:
            opened: List = []

            def enter(_module, _inputs, part=part, opened=opened) -> None:
                opened.append(record_function(f"moe: {part}").__enter__())

            def leave(_module, _inputs, _output, opened=opened) -> None:
                opened.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profile_steps(step: Callable[[], object], model: nn.Module, steps: int = 3, top: int = 12) -> Dict:
    """``steps`` steps under torch.profiler (after the benchmark's own warm-up): ms per step of each phase and
    MoE part, and the ``top`` operators by self CPU time (ms per step, calls per step)."""
    with labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    averages = prof.key_averages()
    labelled_ms = {e.key: e.cpu_time_total / 1e3 / steps for e in averages if e.key.startswith(("phase: ", "moe: "))}
    ops = sorted(
        (e for e in averages if not e.key.startswith(("phase: ", "moe: "))), key=lambda e: -e.self_cpu_time_total
    )
    return {
        "phase_ms": {name: round(labelled_ms.get(f"phase: {name}", 0.0), 2) for name in PHASES},
        "moe_forward_ms": {name: round(labelled_ms.get(f"moe: {name}", 0.0), 2) for name in MOE_PARTS},
        "top_ops": [
            {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 2), "calls": e.count // steps}
            for e in ops[:top]
        ],
    }
