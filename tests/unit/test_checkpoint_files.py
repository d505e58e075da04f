"""Checkpoint files: atomic commit, crash while writing, missing/corrupt files, architecture mismatch."""

import pytest
import torch

from dynmoe_dist.config import load_config
from dynmoe_dist.train import checkpoint as ckpt
from dynmoe_dist.train.checkpoint import CheckpointError, CheckpointManager, complete_checkpoints
from dynmoe_dist.train.loop import Trainer


def _trainer(out_dir, *extra):
    cfg = load_config(
        None,
        [
            "task.num_samples=120",
            "task.max_len=8",
            "model.dim=16",
            "model.num_heads=2",
            "model.ffn_dim=16",
            "train.global_batch_size=8",
            "moe.num_experts=3",
            f"output.out_dir='{out_dir}'",
            *extra,
        ],
    )
    return Trainer(cfg)


def test_save_then_resume_restores_weights_and_step(tmp_path):
    t = _trainer(tmp_path)
    for _ in range(2):
        t.train_step()
    path = CheckpointManager(t).save()
    assert path.name == "step_000002" and (path / "meta.pt").is_file()
    fresh = _trainer(tmp_path)
    assert CheckpointManager(fresh).resume("auto") == path
    assert fresh.step == 2
    for (n, a), (_, b) in zip(t.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(a, b), n
    p = t.moe_layers[0].experts.experts[0].w_in
    q = fresh.moe_layers[0].experts.experts[0].w_in
    assert torch.equal(t.optimizer.state[p]["exp_avg"], fresh.optimizer.state[q]["exp_avg"])


def test_crash_while_writing_leaves_previous_checkpoint(tmp_path, monkeypatch):
    t = _trainer(tmp_path)
    t.train_step()
    first = CheckpointManager(t).save()
    t.train_step()
    real_save = ckpt.atomic_save

    def dying_save(obj, path):
        if path.name == "meta.pt":
            raise KeyboardInterrupt("machine lost while writing")
        real_save(obj, path)

    monkeypatch.setattr(ckpt, "atomic_save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        CheckpointManager(t).save()
    monkeypatch.setattr(ckpt, "atomic_save", real_save)
    assert complete_checkpoints(str(tmp_path)) == [first]
    assert (tmp_path / "checkpoints" / "step_000002.tmp").is_dir()  # the torn one is never picked
    fresh = _trainer(tmp_path)
    assert CheckpointManager(fresh).resume("auto") == first and fresh.step == 1


def test_old_checkpoints_pruned_after_new_one_is_complete(tmp_path):
    t = _trainer(tmp_path, "output.keep_checkpoints=2")
    for _ in range(3):
        t.train_step()
        CheckpointManager(t).save()
    assert [p.name for p in complete_checkpoints(str(tmp_path))] == ["step_000002", "step_000003"]


def test_missing_and_corrupt_checkpoints_name_the_file(tmp_path):
    t = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match=str(tmp_path / "nowhere")):
        CheckpointManager(t).resume(str(tmp_path / "nowhere"))
    assert CheckpointManager(t).resume("auto") is None  # nothing yet: fresh start
    t.train_step()
    path = CheckpointManager(t).save()
    (path / "dense.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"dense\.pt is corrupt"):
        CheckpointManager(_trainer(tmp_path)).resume(str(path))


def test_architecture_mismatch_is_refused(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    path = CheckpointManager(t).save()
    other = _trainer(tmp_path, "model.ffn_dim=32")
    with pytest.raises(CheckpointError, match=r"different \[model\]: ffn_dim 16 != 32"):
        CheckpointManager(other).resume(str(path))


def test_checkpoint_files_load_with_weights_only(tmp_path):
    t = _trainer(tmp_path)
    t.train_step()
    path = CheckpointManager(t).save()
    for file in path.iterdir():
        torch.load(file, weights_only=True)  # raises if anything but tensors and plain containers
