"""Read tensors, and slices of tensors, from a save_pretrained directory without loading whole files.

A directory holds ``model.safetensors``, or ``model.safetensors.index.json`` naming the shard of every key.
Each file is opened with ``safetensors.safe_open`` (memory-mapped) and a slice is read with ``get_slice``:
one expert of a fused (E, ...) tensor reads that expert's bytes only, which is what lets a rank of an
expert-parallel job read its own experts of a large MoE checkpoint. Mistakes in the directory are one-line
ValueErrors naming the file.

Every read opens the file afresh. safetensors returns tensors that are views into its memory map of the
whole file, and every page a view has touched stays in this process's resident set for as long as the map
lives. A handle kept open for the reader's life would keep every page read so far: a rank filling its share
of a checkpoint would hold it twice, its own copy and the file's pages (bench import measured a peak of
2.0x the rank's share). With a handle per read the map goes when the returned tensor does, i.e. once the
caller has copied it. The price is a header parse per read, about 1 microsecond per key in that file (0.24
ms at 230 keys, 2.2 ms at 2000); reading at offsets from headers parsed once would avoid it. Headers
(``shape``) are read through one handle per file, kept: they touch no data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from torch import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
Index = Tuple[Union[int, slice], ...]


class CheckpointReader:
    """Tensors of one checkpoint directory by key; files opened once, on first use."""

    def __init__(self, directory: Union[str, Path]):
        self.directory = Path(directory)
        self.files = _files_by_key(self.directory)
        self._open: Dict[Path, Any] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped

    def keys(self) -> List[str]:
        return list(self.files)

    def file_of(self, key: str) -> Path:
        if key not in self.files:
            raise ValueError(f"{self.directory}: the checkpoint holds no tensor {key!r}")
        return self.files[key]

    def _handle(self, key: str) -> Any:
        from safetensors import safe_open

        path = self.file_of(key)
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def shape(self, key: str) -> Tuple[int, ...]:
        """The stored shape, from the file's header (no tensor data read)."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def _read(self, key: str, index: Optional[Index]) -> Tensor:
        """The tensor, or ``[index]`` of it, through a handle of its own (why: the module's docstring)."""
        from safetensors import safe_open

        with safe_open(str(self.file_of(key)), framework="pt") as f:
            t: Tensor = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        return t

    def tensor(self, key: str) -> Tensor:
        return self._read(key, None)

    def slice(self, key: str, index: Index) -> Tensor:
        """``tensor(key)[index]``, reading only the bytes the index selects (ints and slices, steps allowed)."""
        return self._read(key, index)

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of the first dimension (a router's rows, a range of experts)."""
        return self.slice(key, (slice(start, stop),))


def _files_by_key(directory: Path) -> Dict[str, Path]:
    """key -> the file holding it; ValueError naming the file for a missing file or shard."""
    index_file, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index_file}: no safetensors index with a weight_map ({type(err).__name__})") from None
        files = {key: directory / shard for key, shard in weight_map.items()}
        for key, path in files.items():
            if not path.is_file():
                raise ValueError(f"{index_file}: names shard {path.name!r} (for {key}), which does not exist")
        return files
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {key: single for key in f.keys()}
    raise ValueError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} (not a save_pretrained directory)")


def read_all(directory: Union[str, Path]) -> Dict[str, Tensor]:
    """Every tensor of the checkpoint (tests, small models)."""
    with CheckpointReader(directory) as reader:
        return {key: reader.tensor(key) for key in reader.keys()}
