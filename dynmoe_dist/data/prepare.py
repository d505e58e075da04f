"""Tokenise a corpus once into the token cache; every later start maps it.

``open_corpus(spec)`` is what the task calls (on every rank, before any collective): it computes the
cache key from the corpus files' content hashes, the tokenizer's fingerprint, task.max_len and
task.text_field, reuses a checked entry (and says so), or builds one under a lock: each file is read
with ``datasets``, tokenised by ``Dataset.map`` in ``num_proc`` worker processes, and its token lists
are appended to tokens.bin in file and row order. ``python -m dynmoe_dist.data prepare`` calls the same
function ahead of training.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..paths import missing
from .cache import (
    FORMAT,
    LOSS_FILE,
    TOKEN_DTYPE,
    TokenCorpus,
    build_lock,
    default_cache_dir,
    entry_problem,
    install,
    say,
    tail_range,
    xxh3_of,
)
from .fingerprint import DigestMemo, tokenizer_fingerprint
from .sources import BUILTIN_CORPORA, corpus_files, load_documents, load_records, row_name

# Below this many documents a file is tokenised in the calling process: starting workers costs more.
MIN_DOCS_PER_WORKER = 2000
MAP_BATCH = 1000


@dataclass(frozen=True)
class CorpusSpec:
    """What a token cache entry is made from, and where it lives."""

    path: str
    """task.path (or task.test_path): a file, a directory, or a built-in corpus name."""
    tokenizer: str
    """A model directory with tokenizer files, a .gguf file, or package:NAME (models/hf/loading.py)."""
    max_len: int
    text_field: str = "text"
    cache_dir: str = ""
    """'' = default_cache_dir()."""
    num_proc: int = 0
    """Tokenising worker processes; 0 = one per CPU core, at most 8."""
    field: str = "task.path"
    """The option ``path`` came from, for messages."""
    format: str = "text"
    """'text': documents of text_field, EOS after each (causal-lm); 'chat': conversations rendered with the chat
    template, the assistant's tokens marked (data/chat.py)."""
    chat_template: str = ""
    """format 'chat': a .jinja file with the chat template; '' = the tokenizer's own."""

    def root(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


def key_inputs(spec: CorpusSpec, files: List[Path], memo: DigestMemo) -> Dict[str, Any]:
    """The cache key's inputs; json-serialisable, stored in index.json and compared on every open."""
    return {
        "corpus": [memo.digest(f) for f in files],
        "builtin": spec.path if spec.path in BUILTIN_CORPORA else "",
        "tokenizer": tokenizer_fingerprint(spec.tokenizer, memo),
        "max_len": spec.max_len,
        "text_field": spec.text_field,
        **(chat_key_inputs(spec) if spec.format == "chat" else {}),
    }


def key_of(inputs: Dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_128(json.dumps({"format": FORMAT, **inputs}, sort_keys=True).encode()).hexdigest()


def open_corpus(spec: CorpusSpec, full_check: bool = False) -> TokenCorpus:
    """The checked token cache entry of spec, built first when missing or damaged."""
    root = spec.root()
    files = corpus_files(spec.path, spec.field)
    memo = DigestMemo(root)
    inputs = key_inputs(spec, files, memo)
    memo.save()
    key = key_of(inputs)
    entry = root / key
    problem = entry_problem(entry, inputs, full_check)
    if problem is None:
        return reuse(entry, spec)
    try:
        with build_lock(root / f"{key}.lock"):
            problem = entry_problem(entry, inputs, full_check)  # another process may have built it meanwhile
            if problem is None:
                return reuse(entry, spec)
            if problem != "missing":
                say(f"token cache {entry} not used: {problem}; rebuilding it")
            build(spec, files, inputs, entry)
    except PermissionError as err:
        raise ValueError(
            f"task.cache_dir ({str(root)!r}) is not writable ({err.strerror}: {err.filename}); "
            "prepare the corpus where it is, or point task.cache_dir elsewhere"
        ) from None
    return TokenCorpus(entry, reused=False)


def reuse(entry: Path, spec: CorpusSpec) -> TokenCorpus:
    corpus = TokenCorpus(entry, reused=True)
    say(
        f"reusing the token cache of {spec.field} ({spec.path!r}): {entry} "
        f"({corpus.num_tokens} tokens, {corpus.num_docs} documents)"
    )
    return corpus


@lru_cache(maxsize=2)
def _tokenizer(path: str):
    from .tokenizers import load_tokenizer

    return load_tokenizer(path, "task.tokenizer")


def _tokenise(batch: Dict[str, List[str]], tokenizer_path: str, eos: int) -> Dict[str, List[List[int]]]:
    """Token ids of each document (+ EOS); runs in the map's worker processes, which load the tokenizer once."""
    ids = _tokenizer(tokenizer_path)(batch["text"], add_special_tokens=False)["input_ids"]
    return {"ids": [row + [eos] for row in ids] if eos >= 0 else ids}


def chat_template_text(spec: CorpusSpec) -> str:
    """The chat template a 'chat' corpus is rendered with: task.chat_template's file, else the tokenizer's."""
    if spec.chat_template:
        path = Path(spec.chat_template).expanduser()
        if not path.is_file():
            raise missing("task.chat_template", spec.chat_template)
        return path.read_text(encoding="utf-8")
    own = _tokenizer(spec.tokenizer).chat_template
    if not own:
        raise ValueError(
            f"task.tokenizer ({spec.tokenizer!r}) has no chat template; set task.chat_template to a .jinja file "
            "(launcher/configs/chat_template.jinja is a small one)"
        )
    return own if isinstance(own, str) else json.dumps(own, sort_keys=True)


def chat_key_inputs(spec: CorpusSpec) -> Dict[str, Any]:
    import xxhash

    return {"format": "chat", "chat_template": xxhash.xxh3_128(chat_template_text(spec).encode()).hexdigest()}


def _tokenise_chat(batch: Dict[str, List], tokenizer_path: str, template: Optional[str]) -> Dict[str, List]:
    """Marked token ids of each conversation, its target count, and '' or what is wrong with the row (the
    caller names the first bad row: an exception in a map worker would lose which one it was)."""
    from .chat import loss_tokens, tokenise_record

    tokenizer = _tokenizer(tokenizer_path)
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out: Dict[str, List] = {"ids": [], "loss": [], "error": []}
    for record in rows:
        try:
            ids, error = tokenise_record(tokenizer, template, record), ""
        except ValueError as err:
            ids, error = [], str(err)
        out["ids"].append(ids)
        out["loss"].append(loss_tokens(ids))
        out["error"].append(error)
    return out


def tokenise_chat_file(records, file: Path, spec: CorpusSpec):
    """Dataset of 'ids' and 'loss' per record, in row order; ValueError naming the first bad row."""
    import datasets
    import pyarrow.compute as pc

    template = Path(spec.chat_template).expanduser().read_text(encoding="utf-8") if spec.chat_template else None
    columns = {"loss": datasets.Value("int64"), "error": datasets.Value("string")}
    tokenised = mapped(records, spec, _tokenise_chat, {"template": template}, columns)
    errors = tokenised.data.column("error")
    bad = pc.not_equal(errors, "")
    if pc.any(bad).as_py():
        index = pc.index(bad, True).as_py()
        raise ValueError(f"{row_name(file, index)}: {errors[index].as_py()}")
    return tokenised


def worker_count(spec: CorpusSpec, num_docs: int) -> Optional[int]:
    """map's num_proc: None (the calling process) below MIN_DOCS_PER_WORKER documents per worker."""
    num_proc = spec.num_proc or min(os.cpu_count() or 1, 8)
    num_proc = max(1, min(num_proc, num_docs // MIN_DOCS_PER_WORKER))
    return num_proc if num_proc > 1 else None


def mapped(table, spec: CorpusSpec, tokenise, fn_kwargs: Dict[str, Any], columns: Dict[str, Any]):
    """``table.map(tokenise)`` in worker processes, in row order: an 'ids' column (uint32 lists) and ``columns``."""
    import datasets

    return table.map(
        tokenise,
        batched=True,
        batch_size=MAP_BATCH,
        num_proc=worker_count(spec, len(table)),
        fn_kwargs={"tokenizer_path": spec.tokenizer, **fn_kwargs},
        remove_columns=table.column_names,
        features=datasets.Features({"ids": datasets.Sequence(datasets.Value("uint32")), **columns}),
    )


def tokenise_file(docs, spec: CorpusSpec, eos: int):
    """A Dataset of one 'ids' column (uint32 lists), in row order."""
    return mapped(docs, spec, _tokenise, {"eos": eos}, {})


def append_tokens(tokenised, out, digest) -> List[np.ndarray]:
    """Write a file's token lists to out in order; their lengths, chunk by chunk."""
    import pyarrow.compute as pc

    lengths = []
    for chunk in tokenised.data.column("ids").chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False).astype(TOKEN_DTYPE, copy=False)
        out.write(values.tobytes())
        digest.update(values.tobytes())
        lengths.append(pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64))
    return lengths


def tokenised(spec: CorpusSpec, file: Path, hf_cache: Path, eos: int):
    """One file's Dataset with an 'ids' column (and 'loss', format 'chat'); None when it holds no rows."""
    if spec.format == "chat":
        records = load_records(file, hf_cache)
        return tokenise_chat_file(records, file, spec) if len(records) else None
    docs = load_documents(spec.path, file, spec.text_field, hf_cache)
    # an empty file adds no documents (and map would give it no 'ids' column)
    return tokenise_file(docs, spec, eos) if len(docs) else None


def write_streams(
    spec: CorpusSpec, files: List[Path], build_dir: Path, eos: int
) -> Tuple[np.ndarray, str, Dict[str, Any]]:
    """tokens.bin of all files (format 'chat': with loss_tokens.npy, the targets of each conversation);
    (document offsets, xxh3 of tokens.bin, what index.json adds for the format)."""
    import xxhash

    digest, lengths, loss, file_docs = xxhash.xxh3_64(), [], [], []
    with open(build_dir / "tokens.bin", "wb") as out:
        for file in files:
            table = tokenised(spec, file, build_dir / "hf", eos)
            file_docs.append(0 if table is None else len(table))
            if table is not None:
                lengths += append_tokens(table, out, digest)
                loss += [np.asarray(table.data.column("loss"), dtype=np.int64)] if spec.format == "chat" else []
        out.flush()
        os.fsync(out.fileno())
    extra: Dict[str, Any] = {}
    if spec.format == "chat":
        np.save(build_dir / LOSS_FILE, np.concatenate(loss) if loss else np.zeros(0, dtype=np.int64))
        extra = {"loss_xxh3": xxh3_of(build_dir / LOSS_FILE), "file_docs": file_docs}
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(all_lengths)]), digest.hexdigest(), extra


def build(spec: CorpusSpec, files: List[Path], inputs: Dict[str, Any], entry: Path) -> None:
    """Tokenise spec's files into a new entry (atomically: built aside, renamed into place)."""
    started = time.perf_counter()
    tokenizer = _tokenizer(spec.tokenizer)
    eos = -1 if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)
    for stale in entry.parent.glob(f".build-{entry.name}-*"):  # left by a builder that died (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    build_dir = entry.with_name(f".build-{entry.name}-{os.getpid()}")
    build_dir.mkdir(parents=True)
    try:
        say(f"tokenising {spec.field} ({spec.path!r}, {len(files)} file(s)) into {entry}")
        offsets, tokens_xxh3, format_index = write_streams(spec, files, build_dir, eos)
        num_tokens = int(offsets[-1])
        if len(offsets) == 1 or num_tokens == 0:
            raise ValueError(f"{spec.field} ({spec.path!r}) holds no text ({len(files)} file(s), no documents)")
        np.save(build_dir / "docs.npy", offsets)
        shutil.rmtree(build_dir / "hf", ignore_errors=True)
        seconds = time.perf_counter() - started
        index = {
            "format": FORMAT,
            "inputs": inputs,
            "files": [str(f) for f in files],
            "num_tokens": num_tokens,
            "num_docs": len(offsets) - 1,
            "dtype": TOKEN_DTYPE.name,
            "eos_id": eos,
            "vocab_size": len(tokenizer),
            "tokens_xxh3": tokens_xxh3,
            "tail_xxh3": xxh3_of(build_dir / "tokens.bin", *tail_range(num_tokens * TOKEN_DTYPE.itemsize)),
            "docs_xxh3": xxh3_of(build_dir / "docs.npy"),
            **format_index,
            "prepare_s": seconds,
            "tokens_per_s": num_tokens / max(seconds, 1e-9),
        }
        (build_dir / "index.json").write_text(json.dumps(index, indent=1))
        install(build_dir, entry)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    say(f"tokenised {num_tokens} tokens of {len(offsets) - 1} documents in {seconds:.1f} s into {entry}")
