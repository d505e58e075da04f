"""Read tensors, and slices of tensors, from a save_pretrained directory without loading whole files.

A directory holds ``model.safetensors``, or ``model.safetensors.index.json`` naming the shard of every key.
Each file is opened with ``safetensors.safe_open`` (memory-mapped) and a slice is read with ``get_slice``:
one expert of a fused (E, ...) tensor reads that expert's bytes only, which is what lets a rank of an
expert-parallel job read its own experts of a large MoE checkpoint. Mistakes in the directory are one-line
ValueErrors naming the file: a missing shard, an index without a weight_map, a truncated file or a header
that is not safetensors (``check_weight_files`` looks at every file's header up front, so that a run finds
a bad file before any process group exists).

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
        path = self.file_of(key)
        if path not in self._open:
            self._open[path] = open_safetensors(path)
        return self._open[path]

    def shape(self, key: str) -> Tuple[int, ...]:
        """The stored shape, from the file's header (no tensor data read)."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def _read(self, key: str, index: Optional[Index]) -> Tensor:
        """The tensor, or ``[index]`` of it, through a handle of its own (why: the module's docstring)."""
        with open_safetensors(self.file_of(key)) as f:
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


def open_safetensors(path: Path) -> Any:
    """``safe_open(path)``; a file whose header safetensors cannot read (truncated, not safetensors) is a
    ValueError naming it (safetensors' own error names no file)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def _weight_map(index_file: Path) -> Dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_file}: no safetensors index with a weight_map ({type(err).__name__})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_file}: the weight_map is not a mapping of key -> shard file")
    return weight_map


def _indexed_files(directory: Path) -> Dict[str, Path]:
    """key -> shard, from the index; ValueError naming a shard that does not exist."""
    index_file = directory / INDEX_FILE
    files = {key: directory / shard for key, shard in _weight_map(index_file).items()}
    for key, path in files.items():
        if not path.is_file():
            raise ValueError(f"{index_file}: names shard {path.name!r} (for {key}), which does not exist")
    return files


def _files_by_key(directory: Path) -> Dict[str, Path]:
    """key -> the file holding it; ValueError naming the file for a missing file or shard."""
    if (directory / INDEX_FILE).is_file():
        return _indexed_files(directory)
    single = directory / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return {key: single for key in f.keys()}
    raise ValueError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} (not a save_pretrained directory)")


def check_weight_files(directory: Union[str, Path]) -> None:
    """Every safetensors file a load of ``directory`` reads has a readable header (headers only, no tensor
    data), and every key of the index is in the shard it names; a ValueError naming the file if not. The
    files: the index's shards, else model.safetensors, else whatever ``*.safetensors`` there is (a
    directory without any, e.g. a tokenizer's, passes)."""
    directory = Path(directory)
    if not (directory / INDEX_FILE).is_file():
        for path in sorted(directory.glob("*.safetensors")):
            with open_safetensors(path):
                pass
        return
    by_shard: Dict[Path, List[str]] = {}
    for key, path in _indexed_files(directory).items():
        by_shard.setdefault(path, []).append(key)
    for path, keys in by_shard.items():
        with open_safetensors(path) as f:
            held = set(f.keys())
        missing = [key for key in keys if key not in held]
        if missing:
            raise ValueError(
                f"{directory / INDEX_FILE}: names {path.name!r} for {missing[0]}, which that shard does not hold"
            )


def read_all(directory: Union[str, Path]) -> Dict[str, Tensor]:
    """Every tensor of the checkpoint (tests, small models)."""
    with CheckpointReader(directory) as reader:
        return {key: reader.tensor(key) for key in reader.keys()}
