"""The token cache: one directory per (corpus contents, tokenizer, max_len, text field).

An entry CACHE_DIR/<key>/ holds
  tokens.bin   the corpus' token stream, uint32, documents in file order, each followed by EOS when the
               tokenizer has one (memory-mapped by every rank, never read whole);
  docs.npy     int64 document offsets into tokens.bin (D + 1 of them: document d is [off[d], off[d+1]));
  loss_tokens.npy  (format 'chat' only) int64 targets of each conversation: its assistant tokens (data/chat.py);
  index.json   what the entry was made from (the key's inputs), counts, sizes and xxh3 checksums.
It is built in a temporary directory next to it and renamed into place, so an entry either exists
whole or not at all; a lock file makes concurrent starts (every rank of a job) build it once.

Before an entry is used it is checked: index.json readable and of this format; made from the same
inputs (another tokenizer's entry is named as such); tokens.bin of exactly the size the index says
(truncation); docs.npy and the last MiB of tokens.bin matching their checksums. ``full=True`` (the
``prepare`` command) also checks the whole of tokens.bin. A failed check rebuilds the entry.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Dict, Iterator, Optional

import numpy as np

FORMAT = 1
TOKEN_DTYPE = np.dtype(np.uint32)
TAIL_BYTES = 1 << 20
LOSS_FILE = "loss_tokens.npy"
# How long a start waits for another process that is building the same entry. flock is released when
# its holder dies, so this bounds only a build that is alive and slow.
WAIT_S = float(os.environ.get("DYNMOE_PREPARE_WAIT_S", 6 * 3600))
# The ranks of one job open the same cache at once, so all but one wait for the lock, usually for a
# small corpus built in seconds, or for a build that fails at once (a missing text column), whose one-line
# error must not come after a stray "waiting" line. Only a wait longer than this is worth a line.
QUIET_WAIT_S = 15.0


def say(message: str) -> None:
    """One line on stderr, from rank 0 only (every rank opens the same cache)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"dynmoe_dist.data: {message}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """$DYNMOE_TOKEN_CACHE, else tokens/ in the data directory (tasks/assets.py's: $DYNMOE_DATA_DIR, else
    ~/.cache/dynmoe_dist)."""
    override = os.environ.get("DYNMOE_TOKEN_CACHE", "").strip()
    if override:
        return Path(override).expanduser()
    data_dir = os.environ.get("DYNMOE_DATA_DIR", "").strip()
    return (Path(data_dir).expanduser() if data_dir else Path.home() / ".cache" / "dynmoe_dist") / "tokens"


def xxh3_of(path: Path, start: int = 0, length: Optional[int] = None) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(1 << 24 if remaining is None else min(1 << 24, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining = None if remaining is None else remaining - len(chunk)
    return digest.hexdigest()


def tail_range(num_bytes: int) -> tuple:
    return max(0, num_bytes - TAIL_BYTES), min(num_bytes, TAIL_BYTES)


def read_index(entry: Path) -> Dict[str, Any]:
    return json.loads((entry / "index.json").read_text())


def entry_problem(entry: Path, inputs: Dict[str, Any], full: bool = False) -> Optional[str]:
    """Why this entry cannot be used for these inputs (None: it can); 'missing' when there is none."""
    if not (entry / "index.json").exists():
        return "missing"
    try:
        index = read_index(entry)
    except (OSError, ValueError) as err:
        return f"index.json is unreadable ({err})"
    if index.get("format") != FORMAT:
        return f"index.json has format {index.get('format')!r}, not {FORMAT}"
    made_from = index.get("inputs", {})
    if made_from.get("tokenizer") != inputs["tokenizer"]:
        return (
            f"it was made with another tokenizer (fingerprint {made_from.get('tokenizer')!r}, "
            f"task.tokenizer's is {inputs['tokenizer']!r})"
        )
    if made_from != inputs:
        changed = sorted(k for k in set(made_from) | set(inputs) if made_from.get(k) != inputs.get(k))
        return f"it was made from other inputs ({', '.join(changed)} differ)"
    return file_problem(entry, index, full)


def file_problem(entry: Path, index: Dict[str, Any], full: bool) -> Optional[str]:
    tokens = entry / "tokens.bin"
    want = int(index["num_tokens"]) * TOKEN_DTYPE.itemsize
    size = tokens.stat().st_size if tokens.exists() else -1
    if size != want:
        return f"tokens.bin is truncated or damaged ({size} bytes, index.json says {want})"
    for name, key in (("docs.npy", "docs_xxh3"), (LOSS_FILE, "loss_xxh3")):
        required = name == "docs.npy" or key in index
        if required and (not (entry / name).exists() or xxh3_of(entry / name) != index.get(key)):
            return f"{name} does not match its checksum"
    if xxh3_of(tokens, *tail_range(size)) != index["tail_xxh3"]:
        return "the end of tokens.bin does not match its checksum"
    if full and xxh3_of(tokens) != index["tokens_xxh3"]:
        return "tokens.bin does not match its checksum"
    return None


@contextmanager
def build_lock(lock_file: Path, timeout_s: float = WAIT_S, quiet_s: float = QUIET_WAIT_S) -> Iterator[None]:
    """An exclusive flock on lock_file, waited for at most timeout_s (then a clear error); a wait longer
    than quiet_s is announced once. The holder removes the file when it is done, built or failed, so
    that the cache keeps no lock files."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    held = _acquire(lock_file, time.monotonic(), timeout_s, quiet_s)
    try:
        yield
    finally:
        lock_file.unlink(missing_ok=True)  # before the unlock: a waiter then finds its file gone and retries
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()


def _acquire(lock_file: Path, started: float, timeout_s: float, quiet_s: float) -> IO:
    """The open, flocked lock file. A waiter may lock a file whose holder removed it meanwhile; that lock
    guards nothing (the next start creates and locks a new file), so it takes the file now at the path."""
    told = False
    while True:
        file = open(lock_file, "w")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            if time.monotonic() > started + timeout_s:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for another process building the token cache "
                    f"(lock {lock_file}); run `python -m dynmoe_dist.data prepare` before training"
                ) from None
            if not told and time.monotonic() - started >= quiet_s:
                say(f"waiting for another process that is building this token cache ({lock_file})")
                told = True
            time.sleep(0.2)
            continue
        if _names(lock_file, file):
            return file
        file.close()


def _names(path: Path, file: IO) -> bool:
    """Whether ``path`` is (still) the file open as ``file``."""
    try:
        on_disk, opened = path.stat(), os.fstat(file.fileno())
    except FileNotFoundError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)


def install(built: Path, entry: Path) -> None:
    """Move a finished build into place, replacing a damaged entry (under the build lock)."""
    if entry.exists():
        trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}")
        os.replace(entry, trash)
        os.replace(built, entry)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(built, entry)


class TokenCorpus:
    """A checked cache entry, memory-mapped: the token stream and where each document starts."""

    def __init__(self, entry: Path, reused: bool = True):
        self.entry = entry
        self.reused = reused
        """False when this open built the entry."""
        self.index = read_index(entry)
        num_tokens = int(self.index["num_tokens"])
        # np.memmap refuses a zero-length map; an entry always holds tokens (prepare refuses an empty corpus)
        self.tokens = np.memmap(entry / "tokens.bin", dtype=TOKEN_DTYPE, mode="r", shape=(num_tokens,))
        self.doc_offsets = np.load(entry / "docs.npy", mmap_mode="r")
        self.loss_tokens = np.load(entry / LOSS_FILE, mmap_mode="r") if "loss_xxh3" in self.index else None
        """Targets of each conversation (format 'chat'); None for text."""

    @property
    def num_docs(self) -> int:
        return int(self.index["num_docs"])

    @property
    def num_tokens(self) -> int:
        return int(self.index["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    def where(self, doc: int) -> str:
        """'file:line' (JSON lines) or 'file: row R' of document ``doc`` (format 'chat' records its files' rows)."""
        from .sources import row_name

        ends_F = np.cumsum(self.index["file_docs"])
        file = int(np.searchsorted(ends_F, doc, side="right"))
        return row_name(Path(self.index["files"][file]), doc - int(ends_F[file - 1] if file else 0))

    def packed(self, doc_ids_D, seq_len: int):
        from .packed import PackedExamples

        assert self.loss_tokens is not None, "packed conversations need a 'chat' entry"
        return PackedExamples(self.tokens, self.doc_offsets, self.loss_tokens, doc_ids_D, seq_len)

    def windows(self, doc_ids_D, seq_len: int):
        from .windows import TokenWindows

        return TokenWindows(self.tokens, self.doc_offsets, doc_ids_D, seq_len)
