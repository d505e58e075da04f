"""A text corpus the machine has offline: the docstrings of the running interpreter's Python files.

No small pre-trained MoE ships offline, so `pretrain-moe` trains one, and it needs English text that is
on every machine this project runs on. The docstrings of the standard library and the installed
packages are that: tens of MB of English prose about code (the standard library alone about 1.7 MB).

Extraction is plain ``ast``: the module, class and function docstrings of every ``.py`` file under the
roots (nothing is imported or run), cleaned (``inspect.cleandoc``'s dedent, trailing spaces dropped,
runs of blank lines cut to one), filtered (too short, too few letters, control characters), and
deduplicated by exact text (the first occurrence stays). Files are visited in the order of a hash of
their path under their root: deterministic for one installation, and a cap that stops early still
samples every package instead of the alphabet's first few. The corpus is written as JSON lines, one
``{"text": ...}`` document per line (JSON keeps a docstring's own line breaks inside its one line).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

MIN_CHARS = 40
"""Shorter docstrings ('Return self.', 'Deprecated.') teach the model little and repeat endlessly."""
MIN_WORDS = 6
MIN_LETTER_SHARE = 0.5
"""Docstrings that are mostly symbols (tables, ASCII art, hex dumps) are left out."""
MAX_CHARS = 8000
"""Longer ones (licence texts, whole manuals in a module docstring) are cut at a paragraph break."""
MAX_FILE_BYTES = 2_000_000
"""Generated sources (unicode tables, parser tables) are skipped: huge, and no prose."""
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_BLANK_RUNS = re.compile(r"\n{3,}")
_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class CorpusStats:
    """What a corpus holds, for the JSON line and the results."""

    num_docs: int
    num_bytes: int
    files_read: int
    files_skipped: int
    duplicates: int
    rejected: int
    capped: bool
    """True when the size cap stopped the walk (more docstrings were available)."""
    sha256: str
    """Of the written file: two corpora with the same digest trained the same tokenizer."""

    def to_dict(self) -> Dict:
        return asdict(self)


def default_roots() -> List[Path]:
    """The running interpreter's standard library and its site-packages (purelib and platlib; a venv's
    own), each once."""
    paths = sysconfig.get_paths()
    roots: List[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        root = Path(paths[key]).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def clean(docstring: str) -> Optional[str]:
    """A docstring as a document, or None when it is left out (see the module constants for why)."""
    lines = [line.rstrip() for line in docstring.strip().splitlines()]
    text = _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
    if _CONTROL.search(text) or len(text) < MIN_CHARS or len(text.split()) < MIN_WORDS:
        return None
    if sum(c.isalpha() for c in text) < MIN_LETTER_SHARE * len(text):
        return None
    if len(text) > MAX_CHARS:
        cut = text.rfind("\n\n", 0, MAX_CHARS)
        text = text[: cut if cut > MIN_CHARS else MAX_CHARS].rstrip()
    return text


def file_docstrings(source: str) -> List[str]:
    """The module, class and function docstrings of one source file, in the order ast.walk meets them
    (breadth first: the module's first). Raises SyntaxError / ValueError for a file that does not parse."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node, clean=True)
            if text:
                found.append(text)
    return found


def _order_key(root_index: int, relative: str) -> str:
    return hashlib.sha1(f"{root_index}:{relative}".encode()).hexdigest()


def python_files(roots: Sequence[Path]) -> List[Path]:
    """Every .py file under the roots, in hash order of (root index, path under the root). A root nested in
    another (a venv inside the stdlib tree) is walked once, as itself; __pycache__ is never read, nor a
    site-packages folder inside a root (the base interpreter's, under a venv's stdlib: not this one's)."""
    roots = [Path(r).resolve() for r in roots]
    keyed: List[Tuple[str, Path]] = []
    for index, root in enumerate(roots):
        nested = [other for other in roots if other != root and other.is_relative_to(root)]
        for path in root.rglob("*.py"):
            relative = path.relative_to(root)
            if _SKIPPED_DIRS.intersection(relative.parts) or any(path.is_relative_to(other) for other in nested):
                continue
            keyed.append((_order_key(index, relative.as_posix()), path))
    return [path for _, path in sorted(keyed)]


def _read(path: Path) -> Optional[str]:
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def iter_documents(files: Sequence[Path], counts: Dict[str, int]) -> Iterator[str]:
    """Cleaned docstrings of the files in order, before deduplication; ``counts`` gets files_read,
    files_skipped (unreadable, too large, not Python 3) and rejected (clean() said no)."""
    for path in files:
        source = _read(path)
        try:
            found = file_docstrings(source) if source is not None else None
        except (SyntaxError, ValueError, RecursionError):
            found = None
        if found is None:
            counts["files_skipped"] += 1
            continue
        counts["files_read"] += 1
        for raw in found:
            text = clean(raw)
            if text is None:
                counts["rejected"] += 1
            else:
                yield text


def build_corpus(out: Path, cap_bytes: int, roots: Optional[Sequence[Path]] = None) -> CorpusStats:
    """Write the deduplicated docstrings of ``roots`` (default: default_roots()) to ``out`` as JSON lines
    until their UTF-8 text reaches ``cap_bytes`` (the last document may cross it); returns what it holds."""
    if cap_bytes < 1:
        raise ValueError(f"corpus cap ({cap_bytes} bytes) must be >= 1")
    files = python_files(default_roots() if roots is None else roots)
    counts = {"files_read": 0, "files_skipped": 0, "rejected": 0}
    seen, num_bytes, duplicates, capped = set(), 0, 0, False
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(out, "w", encoding="utf-8") as sink:
        for text in iter_documents(files, counts):
            key = hashlib.sha1(text.encode()).digest()
            if key in seen:
                duplicates += 1
                continue
            if num_bytes >= cap_bytes:
                capped = True
                break
            seen.add(key)
            num_bytes += len(text.encode())
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            sink.write(line)
            digest.update(line.encode())
    if not seen:
        raise ValueError(f"no docstring found under {', '.join(map(str, roots or default_roots()))}")
    return CorpusStats(len(seen), num_bytes, duplicates=duplicates, capped=capped, sha256=digest.hexdigest(), **counts)


def read_corpus(path: Path) -> Iterator[str]:
    """The documents of a corpus file written by build_corpus."""
    with open(path, encoding="utf-8") as source:
        for line in source:
            yield json.loads(line)["text"]
