"""A safetensors file written one tensor at a time, so that saving never holds a second copy of what it saves.

``torch.save`` needs every tensor at once: a checkpoint of experts held on a GPU, or sharded over their
expert-dp group, would first build a whole host copy (weights and both Adam moments) of everything the rank
owns. Here the header (names, dtypes, shapes, offsets) is written from shapes alone, then each tensor is
made a host tensor (a gather of a sharded one, a copy of a device one; a plain host tensor as it is),
written and dropped before the next: the extra memory is one tensor's. The file is the safetensors format
(an 8-byte little-endian header size, the JSON header, the raw little-endian bytes), read back with
``safetensors.safe_open``: memory-mapped, no pickle, and only the tensors asked for.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .dense_state import CheckpointError

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ALIGNMENT = 8  # the header is padded with spaces so the data starts aligned, as safetensors writes it

Named = Sequence[Tuple[str, Tensor]]


def header_of(tensors: Named) -> bytes:
    """The JSON header of ``tensors`` laid back to back in this order, padded to ALIGNMENT."""
    entries: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()  # a DTensor's shape and numel are the whole tensor's
        entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % ALIGNMENT)


def write_streamed(path: Optional[Path], tensors: Named, to_host: Callable[[Tensor], Tensor]) -> None:
    """Write ``tensors`` (name, tensor) into one safetensors file at ``path``, one at a time, each made a
    host tensor by ``to_host`` just before it is written. ``to_host`` may be collective (gathering a sharded
    tensor): every rank of the group then calls this with the same tensors in the same order, and those
    that do not write pass ``path=None``. Atomic: written to a ``.partial`` file, renamed when complete."""
    if path is None:
        for _, t in tensors:
            to_host(t.detach())
        return
    header = header_of(tensors)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, t in tensors:
            host = to_host(t.detach()).contiguous()
            if host.shape != t.shape or host.dtype != t.dtype:
                raise ValueError(f"tensor {name!r}: {tuple(host.shape)} {host.dtype} on the host, {tuple(t.shape)}")
            f.write(host.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own bytes: no copy
            del host
    os.replace(tmp, path)


def read_tensors(path: Path, wanted: Callable[[str], bool] = lambda name: True) -> Dict[str, Tensor]:
    """The tensors of a safetensors file whose names are ``wanted``; a CheckpointError naming the file when
    it is missing, truncated or not one."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if wanted(name)}
    except Exception as err:  # truncated, corrupt or not a safetensors file
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {err}") from err
