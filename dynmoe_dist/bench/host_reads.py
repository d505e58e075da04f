"""Count the host reads our code makes: every call that, on CUDA, waits for the device.

Wraps torch.Tensor.item / tolist / cpu / __bool__ / __int__ / __float__ / nonzero, torch.nonzero,
torch.bincount (CUDA sizes its output from the maximum), repeat_interleave with tensor repeats and no
output_size, masked_select and boolean-mask indexing, and records each call whose *caller* lives in
dynmoe_dist (kernels/ and cluster/ included). Calls made inside torch are left out on purpose: on a
CPU run torch's own scalar reads (e.g. Adam's step counter) touch host tensors that also live on the
host under CUDA, while every call of ours stands for a tensor that lives on the device there.

This runs on CPU, where nothing syncs, so it counts *reads*, not waits; ``gpu-check`` measures the
real CUDA syncs with torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import torch

import dynmoe_dist

TENSOR_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero")


def _source_roots() -> Tuple[str, ...]:
    """Folders of dynmoe_dist, dynmoe_dist.kernels and dynmoe_dist.cluster (each ends with a separator,
    so a sibling folder such as tests/ never matches)."""
    roots = {Path(dynmoe_dist.__file__).resolve().parent}
    for sub in ("kernels", "cluster"):  # a package's folders: kernels/ has no __init__.py, hence no __file__
        module = sys.modules.get(f"dynmoe_dist.{sub}")
        roots.update(Path(folder).resolve() for folder in getattr(module, "__path__", []))
    return tuple(str(root) + "/" for root in roots)


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReadCounter:
    """``with HostReadCounter() as reads: ...``; then ``reads.calls`` lists (kind, 'file:line')."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, str]] = []
        self._roots = _source_roots()
        self._saved: List[Tuple[Any, str, Any]] = []  # (owner, attribute name, original) to restore

    @property
    def count(self) -> int:
        return len(self.calls)

    def by_site(self) -> Counter:
        return Counter(f"{kind} at {site}" for kind, site in self.calls)

    def reset(self) -> None:
        self.calls.clear()

    def _record(self, kind: str) -> None:
        frame = sys._getframe(2)  # 0: _record, 1: the wrapper, 2: its caller
        filename = str(Path(frame.f_code.co_filename).resolve())
        if filename.startswith(self._roots):
            self.calls.append((kind, f"{Path(filename).name}:{frame.f_lineno}"))

    def _wrap(self, owner, name: str, should_count=lambda *a, **k: True) -> None:
        original = getattr(owner, name)
        counter = self

        def wrapper(*args, **kwargs):
            if should_count(*args, **kwargs):
                counter._record(name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> "HostReadCounter":
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "nonzero")
        self._wrap(torch, "bincount")
        self._wrap(torch, "masked_select")
        self._wrap(torch.Tensor, "masked_select")
        unsized = lambda _input, repeats=None, *a, output_size=None, **k: (  # noqa: E731
            isinstance(repeats, torch.Tensor) and output_size is None
        )
        self._wrap(torch, "repeat_interleave", unsized)
        self._wrap(torch.Tensor, "repeat_interleave", unsized)
        self._wrap(torch.Tensor, "__getitem__", lambda _self, index: _is_bool_index(index))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


@contextlib.contextmanager
def counting() -> Iterator[HostReadCounter]:
    with HostReadCounter() as counter:
        yield counter
