"""Threshold calibration of routers converted to top-any (moe/calibration.py, train/calibrate.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import corpus_lines, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.moe.calibration import calibrated_counts, thresholds_for_counts  # noqa: E402


def test_thresholds_select_exactly_the_counted_tokens():
    # 4 tokens, 3 experts; expert 0 must take its 2 best tokens (cos 0.9, 0.5: threshold between 0.5 and 0.1),
    # expert 1 none (above its best, 0.3), expert 2 all four (below its worst, -0.8)
    cos_TE = torch.tensor([[0.9, 0.3, 0.2], [0.1, 0.2, -0.8], [0.5, -0.1, 0.4], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    g = thresholds_for_counts(cos_TE, torch.tensor([2, 0, 4]))
    assert g[0].item() == pytest.approx(0.3) and 0.3 < g[1].item() < 0.3 + 1e-5 and -0.8 - 1e-5 < g[2].item() < -0.8
    assert (cos_TE > g).sum(dim=0).tolist() == [2, 0, 4]


def test_counts_scale_from_the_native_k_and_never_reach_an_unused_expert():
    # 10 tokens routed top-2 (20 choices) as 9, 6, 5, 0; target k 1: 4.5, 3, 2.5, 0 -> floors 4, 3, 2 (9), one
    # more token to the largest remainder among the used experts (expert 0 and 2 tie at .5: the first)
    assert calibrated_counts(torch.tensor([9, 6, 5, 0]), 10, native_k=2, target_k=1.0).tolist() == [5, 3, 2, 0]
    # target k 3 of 4 experts: 13.5, 9, 7.5, 0 -> 14 (the extra token), 9, 7; an expert takes 10 tokens at most,
    # so a saturated expert leaves the mean k short of the target (2.6 here)
    assert calibrated_counts(torch.tensor([9, 6, 5, 0]), 10, native_k=2, target_k=3.0).tolist() == [10, 9, 7, 0]


def test_a_converted_run_starts_at_the_models_k_with_its_own_loads(tmp_path):
    """One process: the tiny OLMoE converted to top-any; the calibration record's mean k per layer is the
    model's k (2) on the sample, the experts the native rule never used sit above every cosine, and the
    held-out loss before any step is recorded."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import calibrate_at_start

    directory, _ = save_moe_checkpoint("olmoe", tmp_path / "olmoe", num_experts=8)
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines(60, 2)) + "\n")
    settings = [
        "task.name='causal-lm'",
        f"task.path='{tmp_path / 'c.txt'}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{directory}'",
        "moe.router='top_any'",
        "moe.calibrate_samples=20",
        "train.precision='float64'",
    ]
    trainer = Trainer(load_config(None, settings))
    record = calibrate_at_start(trainer)
    assert record["kind"] == "calibration" and record["target_k"] == 2.0
    # identical tokens in identical contexts (a 16-word corpus repeats them) have equal cosines and are chosen
    # all or none, so the sample's mean k is the target up to such ties
    assert all(abs(layer["mean_k"] - 2.0) < 0.05 for layer in record["layers"]), record["layers"]
    assert record["test_loss_after_conversion"] > 0
    for layer in trainer.moe_layers:
        assert not torch.equal(layer.router.threshold, torch.zeros_like(layer.router.threshold))
    half = Trainer(load_config(None, settings + ["moe.calibrate_k=1"]))
    assert all(abs(layer["mean_k"] - 1.0) < 0.05 for layer in calibrate_at_start(half)["layers"])
    budget = calibrate_at_start(Trainer(load_config(None, settings + ["moe.target_k=1.5"])))
    assert budget["target_k"] == 1.5  # a compute budget: the calibration starts at it
    assert all(abs(layer["mean_k"] - 1.5) < 0.05 for layer in budget["layers"]), budget["layers"]
    native = Trainer(load_config(None, settings[:5]))
    assert calibrate_at_start(native) is None  # its own routing: nothing to calibrate
