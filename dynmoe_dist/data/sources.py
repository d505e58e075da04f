"""Where a corpus' text comes from: its files, read with the Hugging Face ``datasets`` library.

``task.path`` names a .txt, .jsonl, .parquet or .arrow file, a directory holding such files (searched
recursively, hidden ones skipped, read in sorted path order), or a built-in corpus by name (register_builtin). Every
file becomes one ``datasets.Dataset`` with a single string column 'text', documents in file order:
  .txt      every non-empty line, stripped, is one document (the 'text' builder);
  .jsonl    one JSON object per line, the document under ``task.text_field`` (the 'json' builder);
  .parquet  / .arrow  a table, the document in column ``task.text_field`` ('parquet' / 'arrow' builders;
            .arrow is the Arrow streaming format that ``datasets`` itself writes).
A chat corpus (task 'chat', ``load_records``) is .jsonl / .parquet / .arrow of conversations, read as its
'messages' or 'prompt' / 'completion' columns (data/chat.py says what a record holds).
Everything is local: nothing is downloaded. A mistake in the data is a ValueError naming the file and
the line (text formats, counted from 1) or row (tables, counted from 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

from ..paths import missing

if TYPE_CHECKING:
    from datasets import Dataset

BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
SUFFIXES = tuple(BUILDERS)
TEXT_COLUMN = "text"


# name -> (its documents, the file they come from: that file's content hash keys the token cache).
# Filled by the tasks that ship corpora (tasks/causal_lm.py: 'rotten-tomatoes'); data/ imports no task.
BUILTIN_CORPORA: Dict[str, Tuple[Callable[[], List[str]], Callable[[], Path]]] = {}


def register_builtin(name: str, documents: Callable[[], List[str]], source_file: Callable[[], Path]) -> None:
    BUILTIN_CORPORA[name] = (documents, source_file)


def describe_inputs() -> str:
    return f"a {' / '.join(SUFFIXES)} file, a directory of them or a built-in corpus ({', '.join(BUILTIN_CORPORA)})"


def corpus_files(path_text: str, field: str) -> List[Path]:
    """The files of a corpus, in the order their documents are read; ValueError if there are none."""
    if not path_text:
        raise ValueError(f"{field} ('') must name {describe_inputs()} for task 'causal-lm'")
    if path_text in BUILTIN_CORPORA:
        return [BUILTIN_CORPORA[path_text][1]()]
    path = Path(path_text).expanduser()
    if path.is_dir():
        # hidden files and folders (.ipynb_checkpoints, editors' backups) are not part of a corpus
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in SUFFIXES
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"{field} ({path_text!r}) is a directory without {' / '.join(SUFFIXES)} files")
        return files
    if not path.is_file():
        raise missing(field, path_text)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{field} ({path_text!r}) must be {describe_inputs()}")
    return [path]


def _datasets():
    import datasets  # imported lazily: the core package does not need it

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load_documents(path_text: str, file: Path, text_field: str, hf_cache: Path) -> "Dataset":
    """One file (or the built-in corpus) -> a Dataset with one string column 'text', checked row by row."""
    datasets = _datasets()
    if path_text in BUILTIN_CORPORA:
        return datasets.Dataset.from_dict({TEXT_COLUMN: BUILTIN_CORPORA[path_text][0]()})
    if _is_blank_text_file(file):
        return datasets.Dataset.from_dict({TEXT_COLUMN: []})
    builder = BUILDERS[file.suffix]
    options = {"columns": [text_field]} if file.suffix == ".parquet" and _parquet_has(file, text_field) else {}
    try:
        table = datasets.load_dataset(
            builder, data_files=[str(file)], split="train", cache_dir=str(hf_cache), **options
        )
    except Exception as err:  # the builders raise pyarrow, pandas and datasets errors of many types
        if file.suffix == ".jsonl":
            first_bad_json_line(file, text_field)  # raises with the line number when it can find one
        raise ValueError(f"{file}: not a readable {builder} file ({type(err).__name__}: {_first_line(err)})") from None
    if file.suffix == ".txt":
        return table.map(_strip_lines, batched=True).filter(_non_empty, batched=True)
    try:
        return _text_column(table, file, text_field)
    except ValueError:
        if file.suffix == ".jsonl":  # JSON lines: name the line and what is wrong with it exactly
            first_bad_json_line(file, text_field)
        raise


def load_records(file: Path, hf_cache: Path) -> "Dataset":
    """A chat file (data/chat.py): its 'messages' or 'prompt' / 'completion' columns, one row per conversation."""
    from .chat import chat_columns

    datasets = _datasets()
    if file.suffix == ".txt":
        raise ValueError(f"{file}: a chat corpus is .jsonl, .parquet or .arrow (a .txt line holds no conversation)")
    if _is_blank_text_file(file):
        return datasets.Dataset.from_dict({"messages": []})
    try:
        builder = BUILDERS[file.suffix]
        table = datasets.load_dataset(builder, data_files=[str(file)], split="train", cache_dir=str(hf_cache))
    except Exception as err:  # the builders raise pyarrow, pandas and datasets errors of many types
        if file.suffix == ".jsonl":
            first_bad_conversation_line(file)  # raises with the line number when it can find one
        raise ValueError(f"{file}: not a readable {builder} file ({type(err).__name__}: {_first_line(err)})") from None
    return table.select_columns(chat_columns(table.column_names, file))


def first_bad_conversation_line(file: Path) -> None:
    """Why a chat JSON lines file did not load, with its line number (called on failure only)."""
    from .chat import conversation_of

    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    conversation_of(json_object(line, f"{file}:{number}"))
                except ValueError as err:
                    where = f"{file}:{number}"
                    raise ValueError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None


def _parquet_has(file: Path, column: str) -> bool:
    """Whether the parquet schema (footer metadata only) has the column: then only that column is read
    (a table's other columns are not copied into the builder's cache); if not, the full read fails later
    with the list of columns."""
    import pyarrow.parquet as pq

    try:
        return column in pq.read_schema(file).names
    except Exception:  # not parquet at all: the builder's error names the file
        return False


def _is_blank_text_file(file: Path) -> bool:
    """Empty .txt / .jsonl files hold no documents (the json builder fails on them rather than say so)."""
    if file.suffix not in (".txt", ".jsonl"):
        return False
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def _strip_lines(batch: Dict[str, List[str]]) -> Dict[str, List[str]]:
    return {TEXT_COLUMN: [line.strip() for line in batch[TEXT_COLUMN]]}


def _non_empty(batch: Dict[str, List[str]]) -> List[bool]:
    return [bool(line) for line in batch[TEXT_COLUMN]]


def _first_line(err: Exception) -> str:
    text = str(err)
    return text.splitlines()[0] if text else ""


def _text_column(table: "Dataset", file: Path, text_field: str) -> "Dataset":
    """The documents of a table: column text_field, which must exist and hold strings only (no nulls)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if text_field not in table.column_names:
        raise ValueError(f"{file}: no column {text_field!r} (task.text_field); columns: {table.column_names}")
    column = table.data.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        where = row_name(file, 0)
        first = column[0].as_py() if len(column) else None
        raise ValueError(f"{where}: {text_field!r} must be a string, got {column.type} ({first!r:.60})")
    nulls = pc.is_null(column)
    if pc.any(nulls).as_py():
        index = pc.index(nulls, True).as_py()
        raise ValueError(f"{row_name(file, index)}: {text_field!r} must be a string, got null")
    table = table.select_columns([text_field])
    return table.rename_column(text_field, TEXT_COLUMN) if text_field != TEXT_COLUMN else table


def row_name(file: Path, index: int) -> str:
    """'file:LINE' for JSON lines (the line of the index-th record, blank lines skipped), else 'file: row I'."""
    if file.suffix == ".jsonl":
        return f"{file}:{_line_of_record(file, index)}"
    return f"{file}: row {index}"


def _line_of_record(file: Path, index: int) -> int:
    seen = -1
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == index:
                return number
    return seen + 1


def json_object(line: str, where: str, expected: str = "a JSON object") -> dict:
    """One JSON lines record, which must be an object; ``where`` ('file:line') prefixes every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected {expected}, got {type(record).__name__}")
    return record


def first_bad_json_line(file: Path, text_field: str) -> None:
    """Find why a JSON lines file did not load and raise with its line number (called on failure only:
    the file is read by ``datasets``; this pass exists to point at the line)."""
    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json_object(line, f"{file}:{number}")
            if text_field not in record:
                raise ValueError(f"{file}:{number}: no key {text_field!r} (task.text_field); keys: {sorted(record)}")
            if not isinstance(record[text_field], str):
                value = record[text_field]
                raise ValueError(
                    f"{file}:{number}: {text_field!r} must be a string, got {type(value).__name__} ({value!r:.60})"
                )
