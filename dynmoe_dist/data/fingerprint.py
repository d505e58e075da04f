"""Content hashes of the corpus files and of the tokenizer: what the token cache is keyed by.

Hashes are xxh3-128 (``xxhash``, a ``datasets`` dependency: about 10 GB/s, so hashing never dominates a
start). A file's hash is remembered in ``CACHE_DIR/digests.json`` under its path, size, mtime and inode;
a later start with the same four reuses it instead of reading the file again (how make and rsync decide
a file is unchanged). Changing a file's content changes its mtime, hence its hash and the cache key.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

# Files a transformers tokenizer is made of, besides tokenizer*.json / *.model (tokenizer_files below).
TOKENIZER_EXTRA_FILES = ("vocab.json", "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json")
MEMO_FILE = "digests.json"
CHUNK = 1 << 24


def content_digest(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


class DigestMemo:
    """path -> content hash, remembered across runs by (path, size, mtime, inode)."""

    def __init__(self, cache_dir: Path):
        self.file = cache_dir / MEMO_FILE
        try:
            self.entries: Dict[str, str] = json.loads(self.file.read_text())
        except (OSError, ValueError):
            self.entries = {}  # a missing or damaged memo only costs re-reading the files
        self.changed = False

    def digest(self, path: Path) -> str:
        key = _stat_key(path)
        if key not in self.entries:
            self.entries[key] = content_digest(path)
            self.changed = True
        return self.entries[key]

    def save(self) -> None:
        """Atomically (a concurrent reader sees the old or the new memo, never half of one)."""
        if not self.changed:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.file)
        except OSError:
            return  # a read-only cache of prepared entries: the memo only saves re-reading files
        self.changed = False


def tokenizer_files(tokenizer_path: str, field: str = "task.tokenizer") -> List[Path]:
    """The files that define the tokenizer: its files in a model directory, or the .gguf file itself."""
    from ..models.hf.loading import resolve
    from .tokenizers import TOKENIZER_FILES

    directory, gguf_file = resolve(tokenizer_path, field)
    if gguf_file is not None:
        return [directory / gguf_file]
    names = set(TOKENIZER_FILES) | set(TOKENIZER_EXTRA_FILES)
    found = sorted(
        p for p in directory.iterdir() if p.is_file() and (p.name in names or p.name.startswith("tokenizer"))
    )
    if not any(p.name in TOKENIZER_FILES for p in found):
        raise ValueError(f"{field} ({tokenizer_path!r}) holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return found


def tokenizer_fingerprint(tokenizer_path: str, memo: DigestMemo, field: str = "task.tokenizer") -> str:
    """One hash of the tokenizer's files (names and contents): another tokenizer, another fingerprint."""
    import xxhash

    parts: List[Tuple[str, str]] = [(p.name, memo.digest(p)) for p in tokenizer_files(tokenizer_path, field)]
    return xxhash.xxh3_128(json.dumps(parts).encode()).hexdigest()
