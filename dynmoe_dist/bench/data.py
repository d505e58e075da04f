"""`python -m dynmoe_dist.bench data`: the token cache at corpus scale — prepare once, start fast, flat memory.

For each size (``--sizes-gb``, default 0.1 and 1 GB of text) the benchmark
  1. generates a corpus (JSON lines of random-word documents, 50 to 500 words each, drawn from a fixed
     vocabulary of 4096 pseudo-words; deterministic; written under ``--work-dir``, never checked in);
  2. prepares it (what ``python -m dynmoe_dist.data prepare`` does, in the benchmark's process) with a
     word-level tokenizer over that vocabulary (saved with a tiny random LLaMA, the model of step 3):
     prepare time and tokens/s; then again, which must reuse the entry (its time is the full check of
     a reused entry);
  3. starts a 2-rank torchrun job (``python -m torch.distributed.run --standalone``) that trains the tiny
     LLaMA (2 blocks, block 1 upcycled to 2 experts, expert-parallel over both ranks) for a few steps on
     the prepared corpus. Every rank reports: ``startup_s`` = time from its process start (from
     /proc/self/stat) to the end of its first optimizer step, minus ``model_load_s`` (building the model,
     transformers' import included); ``data_open_s`` = building the task (key, checks, maps); and
     ``peak_rss_mb`` = its peak resident memory (VmHWM) after the steps.
Targets: startup_s <= 5 on every rank; peak RSS per rank at the largest size within 10 % of the smallest.
``--tiny`` runs the same pipeline on 1 and 2 MB (the default test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from .measure import emit_json, machine_info

TARGETS = {"startup_s": 5.0, "rss_growth": 0.10}
VOCAB_SIZE = 4096
MAX_LEN = 127  # windows of 128 tokens
STEPS = 5
GB = 1e9


# -- the corpus, the tokenizer, the model ---------------------------------------------------------------
def vocabulary() -> List[str]:
    """VOCAB_SIZE distinct pseudo-words of 2 to 9 letters (fixed seed)."""
    rng = np.random.default_rng(0)
    words: Dict[str, None] = {}
    while len(words) < VOCAB_SIZE:
        length = int(rng.integers(2, 10))
        words["".join(chr(97 + int(c)) for c in rng.integers(0, 26, length))] = None
    return list(words)


def write_corpus(path: Path, target_bytes: int, seed: int = 0) -> Dict[str, int]:
    """Documents until the file holds target_bytes of text; (bytes, documents)."""
    rng = np.random.default_rng(seed)
    words = np.array([w.encode() for w in vocabulary()], dtype=object)
    written = num_docs = 0
    with open(path, "wb") as f:
        while written < target_bytes:
            lines = []
            for _ in range(256):
                text = b" ".join(words[rng.integers(0, VOCAB_SIZE, int(rng.integers(50, 501)))])
                lines.append(b'{"text": "' + text + b'"}\n')
            block = b"".join(lines)
            f.write(block)
            written += len(block)
            num_docs += len(lines)
    return {"corpus_bytes": written, "corpus_docs": num_docs}


def save_model(directory: Path) -> None:
    """A word-level tokenizer over the vocabulary and a tiny random LLaMA with its embedding size."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    cfg = tf.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_LEN + 1,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(directory)


def run_settings(model_dir: Path, corpus: Path, cache: Path, out_dir: Path) -> List[str]:
    return [
        "task.name='causal-lm'",
        f"task.path='{corpus}'",
        f"task.max_len={MAX_LEN}",
        f"task.cache_dir='{cache}'",
        "task.test_fraction=0.01",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        "model.num_layers=2",
        "model.moe_layers=[1]",
        "moe.num_experts=2",
        "parallel.ep_size=2",
        "adaptive.enabled=false",
        "train.global_batch_size=8",
        f"train.max_steps={STEPS}",
        f"output.out_dir='{out_dir}'",
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
    ]


# -- one rank of the 2-rank job ---------------------------------------------------------------------------
def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; its resolution is one clock tick)."""
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    stat_lines = Path("/proc/stat").read_text().splitlines()
    boot = next(int(line.split()[1]) for line in stat_lines if line.startswith("btime"))
    return time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))


def peak_rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")) / 1024


def rank_main(settings: List[str], result_dir: Path) -> None:
    """Time a rank's start: the task (data) and the model separately, then the first and further steps."""
    entered_at = process_age_s()  # the interpreter's start and the imports of `-m dynmoe_dist.bench.data` (torch)
    from ..config import load_config
    from ..train import loop

    seconds = {"data_open_s": 0.0, "model_load_s": 0.0}

    def timed(name, fn):
        def wrapper(*args):
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                seconds[name] += time.perf_counter() - started

        return wrapper

    # instrumentation of this process only: how long the Trainer spends opening the data and loading the model
    loop.build_task = timed("data_open_s", loop.build_task)
    loop.build_model = timed("model_load_s", loop.build_model)
    trainer = loop.Trainer(load_config(None, settings))
    built_at = process_age_s()
    trainer.train_step()
    first_step_at = process_age_s()
    for _ in range(STEPS - 1):
        trainer.train_step()
    rank = trainer.groups.rank
    result = {
        "rank": rank,
        "startup_s": first_step_at - seconds["model_load_s"],
        "interpreter_and_torch_import_s": entered_at,
        **seconds,
        "first_step_s": first_step_at - built_at,
        "peak_rss_mb": peak_rss_mb(),
        "num_train_windows": trainer.task.size("train"),
    }
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))


# -- the driver -------------------------------------------------------------------------------------------
def child_env() -> Dict[str, str]:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def prepare(model_dir: Path, corpus: Path, cache: Path) -> Dict:
    """What ``python -m dynmoe_dist.data prepare`` does, in this process (no interpreter start to time)."""
    from ..data import CorpusSpec, open_corpus

    started = time.perf_counter()
    corpus_ = open_corpus(CorpusSpec(str(corpus), str(model_dir), MAX_LEN, cache_dir=str(cache)), full_check=True)
    return {**corpus_.index, "reused": corpus_.reused, "command_s": time.perf_counter() - started}


def two_rank_run(settings: List[str], result_dir: Path) -> List[Dict]:
    result_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "dynmoe_dist.bench.data", "--rank-worker", str(result_dir), "--", *settings]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"2-rank run failed: {done.stdout[-1500:]} {done.stderr[-3000:]}")
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(2)]


def measure_size(size_gb: float, work: Path, model_dir: Path) -> Dict:
    corpus = work / f"corpus_{size_gb:g}gb.jsonl"
    started = time.perf_counter()
    made = write_corpus(corpus, int(size_gb * GB))
    generate_s = time.perf_counter() - started
    cache = work / f"cache_{size_gb:g}"
    first, again = prepare(model_dir, corpus, cache), prepare(model_dir, corpus, cache)
    ranks = two_rank_run(run_settings(model_dir, corpus, cache, work / f"run_{size_gb:g}"), work / f"ranks_{size_gb:g}")
    corpus.unlink()  # the text is no longer needed (the run read the cache); keeps the disk footprint at one size
    return {
        "size_gb": size_gb,
        **made,
        "generate_s": generate_s,
        "num_tokens": first["num_tokens"],
        "prepare_s": first["prepare_s"],
        "prepare_tokens_per_s": first["tokens_per_s"],
        "prepare_workers": min(os.cpu_count() or 1, 8),
        "second_prepare_reused": again["reused"],
        "second_prepare_s": again["command_s"],
        "ranks": ranks,
        "startup_s_max": max(r["startup_s"] for r in ranks),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in ranks),
    }


def summarise(sizes: List[Dict]) -> Dict:
    smallest, largest = sizes[0]["peak_rss_mb_max"], sizes[-1]["peak_rss_mb_max"]
    growth = largest / smallest - 1
    startup = max(s["startup_s_max"] for s in sizes)
    return {
        "rss_growth_largest_over_smallest": growth,
        "startup_s_max": startup,
        "meets_targets": {
            "startup_s": startup <= TARGETS["startup_s"],
            "rss_growth": abs(growth) <= TARGETS["rss_growth"],
        },
    }


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.bench data", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gb", default="0.1,1", help="corpus sizes in GB of text, comma-separated")
    p.add_argument("--tiny", action="store_true", help="1 and 2 MB corpora: a smoke run")
    p.add_argument("--work-dir", default="", help="where corpora and caches go (default: a temporary directory)")
    p.add_argument("--out", default="", help="also write the JSON result to this file")
    args = p.parse_args(argv)
    try:
        sizes = [0.001, 0.002] if args.tiny else [float(s) for s in args.sizes_gb.split(",")]
    except ValueError:
        p.exit(2, f"error: --sizes-gb ({args.sizes_gb!r}) must be comma-separated numbers\n")
    if not sizes or min(sizes) <= 0:
        p.exit(2, f"error: --sizes-gb ({args.sizes_gb!r}) must be positive\n")
    args.sizes = sorted(sizes)
    return args


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-worker"]:  # one rank of two_rank_run (started by torchrun)
        rank_main(argv[3:], Path(argv[1]))
        return
    args = parse(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dynmoe-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        save_model(work / "model")
        sizes = [measure_size(size, work, work / "model") for size in args.sizes]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result = {"benchmark": "data", "targets": TARGETS, "sizes": sizes, **summarise(sizes), "machine": machine_info(1)}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
