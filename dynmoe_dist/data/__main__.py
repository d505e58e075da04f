"""`python -m dynmoe_dist.data prepare`: tokenise a corpus into the token cache ahead of training.

    python -m dynmoe_dist.data prepare --config RUN.toml [--set task.path=...]   # the run's task.path
                                                                               # (and task.test_path);
                                                                               # task 'causal-lm' or 'chat'
    python -m dynmoe_dist.data prepare --path CORPUS --tokenizer MODEL --max-len 512 [--text-field text]

A run with the same corpus, tokenizer, task.max_len and task.text_field then reuses the entry (and
says so). Prints one JSON object per corpus: the entry, whether it was reused, token and document
counts, and the prepare time and tokens/s of the build. A reused entry is checked in full (its whole
token file against the checksum). A mistake is one line 'error: ...' and exit status 2.

This module reads run files (dynmoe_dist.config), so it sits in the train layer of tests/unit/test_layering.py
although it lives in the data package, where `python -m dynmoe_dist.data` finds it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from .prepare import CorpusSpec, open_corpus

USAGE_ERROR = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise a corpus into the token cache")
    prep.add_argument("--config", help="TOML run file: its task.path / task.test_path with its tokenizer")
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    prep.add_argument("--path", help="corpus: a .txt / .jsonl / .parquet / .arrow file or a directory of them")
    prep.add_argument("--tokenizer", help="model directory with tokenizer files, .gguf file or package:NAME")
    prep.add_argument("--max-len", type=int, help="task.max_len of the runs that will read it")
    prep.add_argument("--text-field", default="text", help="column / key of the text (default 'text')")
    prep.add_argument("--cache-dir", default="", help="token cache directory (default $DYNMOE_TOKEN_CACHE or ~/.cache)")
    prep.add_argument("--workers", type=int, default=0, help="tokenising processes (0 = one per core, at most 8)")
    return p


def specs_from_config(args) -> List[CorpusSpec]:
    from ..config import load_config
    from ..tasks import causal_lm, chat

    config = load_config(args.config, args.overrides)
    specs_of = {"causal-lm": causal_lm.corpus_spec, "chat": chat.corpus_spec}
    if config.task.name not in specs_of:
        raise ValueError(f"task.name ({config.task.name!r}) must be one of {sorted(specs_of)} to prepare a token cache")
    corpus_spec, task = specs_of[config.task.name], config.task
    found = [corpus_spec(task, task.path, "task.path")]
    return found + ([corpus_spec(task, task.test_path, "task.test_path")] if task.test_path else [])


def specs_from_flags(args) -> List[CorpusSpec]:
    for flag in ("path", "tokenizer", "max_len"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required without --config")
    if args.max_len < 2:
        raise ValueError(f"--max-len ({args.max_len}) must be >= 2")
    if args.workers < 0:
        raise ValueError(f"--workers ({args.workers}) must be >= 0")
    spec = CorpusSpec(
        path=args.path,
        tokenizer=args.tokenizer,
        max_len=args.max_len,
        text_field=args.text_field,
        cache_dir=args.cache_dir,
        num_proc=args.workers,
        field="--path",
    )
    return [spec]


def prepare(args) -> List[dict]:
    import dynmoe_dist.tasks.causal_lm  # noqa: F401  (registers the built-in corpora)

    specs = specs_from_config(args) if args.config else specs_from_flags(args)
    results = []
    for spec in specs:
        started = time.perf_counter()
        corpus = open_corpus(spec, full_check=True)
        index = corpus.index
        results.append(
            {
                "corpus": spec.field,
                "path": spec.path,
                "entry": str(corpus.entry),
                "reused": corpus.reused,
                "num_tokens": corpus.num_tokens,
                "num_docs": corpus.num_docs,
                "seconds": time.perf_counter() - started,
                "prepare_s": index["prepare_s"],
                "tokens_per_s": index["tokens_per_s"],
            }
        )
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        for result in prepare(args):
            print(json.dumps(result))
    except (ValueError, TimeoutError) as err:
        print(f"python -m dynmoe_dist.data: error: {' '.join(str(err).split())}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
