"""Frozen-MiniLM baseline for minilm-sentiment: sentence embeddings + logistic regression.

``python -m dynmoe_dist.experiments.baseline [--max-len 64] [--num-layers 6] ...`` (or
``python -m dynmoe_dist.experiments baseline ...``) prints one JSON object.

Shape legend: N samples, L tokens, D hidden dim.

Uses exactly the task's train/test split (same seed, test_fraction, max_len), so the number is the
floor a fine-tuned (dense or upcycled DynMoE) model on that task should beat.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..config import TaskConfig
from ..models.hf.minilm import HFSentenceClassifier, load_minilm
from ..tasks import build_task
from ..tasks.assets import minilm_dir


@torch.no_grad()
def embed_split(model: HFSentenceClassifier, tensors, batch_size: int) -> np.ndarray:
    """L2-normalised mean-pooled embeddings (N, D), as sentence-transformers returns for this model."""
    outs = []
    for start in range(0, tensors["tokens_BL"].shape[0], batch_size):
        tokens_BL = tensors["tokens_BL"][start : start + batch_size]
        valid_BL = tensors["valid_BL"][start : start + batch_size]
        pooled_BD, _ = model.embed(tokens_BL, valid_BL)
        outs.append(F.normalize(pooled_BD, dim=-1))
    return torch.cat(outs).numpy()


def run(args) -> dict:
    from sklearn.linear_model import LogisticRegression

    started = time.perf_counter()
    task = build_task(
        TaskConfig(
            name="minilm-sentiment",
            max_len=args.max_len,
            test_fraction=args.test_fraction,
            seed=args.seed,
            num_samples=args.num_samples,
        )
    )
    built = time.perf_counter()
    model = HFSentenceClassifier(load_minilm(minilm_dir(), args.num_layers), task.num_classes).eval()
    train_ND = embed_split(model, task.splits["train"], args.batch_size)
    test_ND = embed_split(model, task.splits["test"], args.batch_size)
    embedded = time.perf_counter()
    clf = LogisticRegression(C=args.C, max_iter=2000).fit(train_ND, task.splits["train"]["targets"].numpy())
    return {
        "task": "minilm-sentiment",
        "max_len": args.max_len,
        "test_fraction": args.test_fraction,
        "seed": args.seed,
        "num_layers": args.num_layers,
        "C": args.C,
        "num_train": int(train_ND.shape[0]),
        "num_test": int(test_ND.shape[0]),
        "train_accuracy": float(clf.score(train_ND, task.splits["train"]["targets"].numpy())),
        "test_accuracy": float(clf.score(test_ND, task.splits["test"]["targets"].numpy())),
        "truncated_fraction": float(task.splits["train"]["valid_BL"][:, -1].float().mean()),
        "task_build_s": round(built - started, 3),
        "embed_s": round(embedded - built, 3),
        "fit_s": round(time.perf_counter() - embedded, 3),
    }


def main(argv=None, prog: str = "python -m dynmoe_dist.experiments.baseline") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-samples", type=int, default=0, help="0 = the whole corpus")
    parser.add_argument("--num-layers", type=int, default=6, help="MiniLM layers kept (1..6)")
    parser.add_argument("--C", type=float, default=1.0, help="inverse regularisation of the logistic regression")
    parser.add_argument("--batch-size", type=int, default=128)
    print(json.dumps(run(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
