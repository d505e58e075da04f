"""Which implementation of the routed-row gather and combine runs: the fused Triton kernels or torch.

``DYNMOE_KERNELS`` chooses: ``auto`` (default) takes Triton for CUDA tensors when triton is installed,
torch everywhere else; ``torch`` never takes Triton (a fallback switch for a broken Triton install);
``triton`` takes it for every tensor, which on CPU works only under ``TRITON_INTERPRET=1`` (tests).
triton is imported lazily, on the first CUDA call, so a CPU-only install never pays for it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Optional

from torch import Tensor

MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("DYNMOE_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"DYNMOE_KERNELS ({mode!r}) must be one of {MODES}")
    return mode


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _permute_module() -> ModuleType:
    return importlib.import_module("dynmoe_dist.kernels.permute_triton")


def permute_kernels(t: Tensor) -> Optional[ModuleType]:
    """The Triton gather/combine module for tensors like ``t``, or None for the torch path."""
    mode = kernel_mode()
    if mode == "triton" and not triton_available():
        raise ValueError("DYNMOE_KERNELS ('triton') needs triton: pip install -e '.[triton]' in the checkout")
    if mode == "torch" or not triton_available():
        return None
    if mode == "auto" and not t.is_cuda:
        return None
    return _permute_module()
