"""The dense state as a torch.distributed.checkpoint directory (train/dense_state.py), gloo, float64:

- under FSDP nothing gathers a whole dense tensor: no DTensor.full_tensor during save or load, each
  rank's data file holds exactly its own shards (they add up to the full size, one rank's share ~1/W);
- a rank killed in the middle of a DCP save leaves the previous checkpoint usable, and the resume from it
  gives the uninterrupted run's losses;
- resuming reshards, after adaptive events (experts removed and added before both checkpoints):
  1 -> 2 ranks (replicate -> fsdp), 2 -> 3 and 3 -> 2 ranks (fsdp -> fsdp, uneven shards on 3 ranks),
  3 -> 1 rank (fsdp -> replicate); every leg continues the one-process reference's losses (1e-9).
"""

import json
import os

import pytest
import torch
from tiny_runs import tiny_run_overrides, tweaked_trainer

from dynmoe_dist.parallel.simulate import SimulationError, run_simulated

STEPS, EVERY = 16, 6  # events after steps 4, 10 and 16; checkpoints at 6 (one event past) and 12 (two)


def _config(out_dir, dense, ep_size, resume=""):
    from dynmoe_dist.config import load_config

    return load_config(
        None,
        [
            *tiny_run_overrides(ep_size, STEPS, period=6, expert_init="reuse_discarded"),
            f"parallel.dense_sharding='{dense}'",
            f"output.out_dir='{out_dir}'",
            f"output.resume='{resume}'",
            f"output.checkpoint_every={EVERY}",
            "output.keep_checkpoints=5",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
        ],
    )


def train(out_dir, dense, ep_size, resume=""):
    """A run to STEPS (a fresh one with the tweaked thresholds; a resumed one takes them from the
    checkpoint), counting whole-tensor gathers inside the dense save and load."""
    from torch.distributed.tensor import DTensor

    from dynmoe_dist.train import checkpoint_parts as checkpoint
    from dynmoe_dist.train.run import run

    gathers = {"save": 0, "load": 0}
    real_full, inside = DTensor.full_tensor, []

    def counting_full(self, *args, **kwargs):
        for phase in inside:
            gathers[phase] += 1
        return real_full(self, *args, **kwargs)

    def spied(phase, fn):
        def wrapper(*args, **kwargs):
            inside.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                inside.pop()

        return wrapper

    real = checkpoint.save_dense, checkpoint.load_dense
    DTensor.full_tensor = counting_full
    checkpoint.save_dense, checkpoint.load_dense = spied("save", real[0]), spied("load", real[1])
    try:
        config = _config(out_dir, dense, ep_size, resume)
        run(config, trainer=None if resume else tweaked_trainer(config))
    finally:
        DTensor.full_tensor = real_full
        checkpoint.save_dense, checkpoint.load_dense = real
    return gathers


def die_in_second_save(out_dir):
    """2 ranks, fsdp: the save at step 6 completes; in the one at step 12 rank 1 is killed (os._exit, no
    clean-up) right after writing its first tensor."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    from dynmoe_dist.train import checkpoint_parts as checkpoint

    saves, real_save, real_write = [], checkpoint.save_dense, filesystem._write_item

    def counting_save(*args, **kwargs):
        saves.append(1)
        return real_save(*args, **kwargs)

    def dying_write(*args, **kwargs):
        out = real_write(*args, **kwargs)
        if len(saves) == 2 and dist.get_rank() == 1:
            os._exit(9)
        return out

    checkpoint.save_dense, filesystem._write_item = counting_save, dying_write
    train(out_dir, "fsdp", 2)


def resume_twice(leg_a, from_a, leg_b, from_b):
    return train(leg_a, "fsdp", 2, from_a), train(leg_b, "fsdp", 2, from_b)


def _losses(out_dir):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "step"}


def _assert_continues(out_dir, reference, first_step):
    losses = _losses(out_dir)
    assert sorted(losses) == list(range(first_step, STEPS + 1)), out_dir
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= 1e-9 * abs(reference[step]), (out_dir, step)


def _shard_bytes_by_file(dense_dir):
    """(bytes of the FSDP-sharded tensors' chunks in each data file, their full size), from DCP's metadata.
    Replicated tensors (routers, Adam's step) have one chunk and are written once, by one rank."""
    from dynmoe_dist.train.dense_state import read_metadata

    metadata = read_metadata(dense_dir)
    entries = {k: e for k, e in metadata.state_dict_metadata.items() if len(e.chunks) > 1}
    by_file = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in entries:
            entry = entries[index.fqn]
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
            nbytes = torch.Size(chunk.sizes).numel() * entry.properties.dtype.itemsize
            by_file[info.relative_path] = by_file.get(info.relative_path, 0) + nbytes
    return by_file, sum(e.size.numel() * e.properties.dtype.itemsize for e in entries.values())


def _assert_sharded_files(dense_dir, world):
    by_file, total = _shard_bytes_by_file(dense_dir)
    assert sorted(by_file) == [f"__{r}_0.distcp" for r in range(world)], by_file
    assert sum(by_file.values()) == total > 0  # every shard once: nothing written twice, nothing whole
    assert max(by_file.values()) <= 1.25 * total / world, (by_file, total)
    # On disk (torch.save framing per tensor dominates at this size): every rank's file about 1/W of them.
    sizes = [(dense_dir / name).stat().st_size for name in by_file]
    assert all(size >= by_file[name] for name, size in zip(by_file, sizes))
    assert max(sizes) <= 1.3 * sum(sizes) / world, sizes


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_dcp")
    reference = root / "reference"
    train(str(reference), "replicate", 1)
    killed = root / "killed"
    with pytest.raises(SimulationError):
        run_simulated(die_in_second_save, 2, args=(str(killed),), timeout_s=300, collective_timeout_s=30)
    three = root / "three"
    from_killed = killed / "checkpoints" / "step_000006"
    gathers3 = run_simulated(train, 3, args=(str(three), "fsdp", 3, str(from_killed)), timeout_s=300)
    a, b = root / "three_to_two", root / "one_to_two"
    from_three, from_reference = three / "checkpoints" / "step_000012", reference / "checkpoints" / "step_000012"
    gathers2 = run_simulated(
        resume_twice, 2, args=(str(a), str(from_three), str(b), str(from_reference)), timeout_s=300
    )
    back = root / "back"
    train(str(back), "replicate", 1, str(from_three))
    return dict(root=root, reference=_losses(reference), gathers=gathers3 + [g for pair in gathers2 for g in pair])


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(legs):
    from dynmoe_dist.train.checkpoint import complete_checkpoints

    killed = legs["root"] / "killed"
    assert [p.name for p in complete_checkpoints(str(killed))] == ["step_000006"]
    torn = killed / "checkpoints" / "step_000012.tmp" / "dense"
    assert torn.is_dir() and not (torn / ".metadata").exists(), "the kill must fall inside the DCP save"
    _assert_sharded_files(killed / "checkpoints" / "step_000006" / "dense", 2)
    # resumed on 3 ranks from the checkpoint before the torn one (2 -> 3, fsdp -> fsdp)
    _assert_continues(legs["root"] / "three", legs["reference"], EVERY + 1)


def test_fsdp_saves_write_each_shard_once_and_gather_nothing(legs):
    _assert_sharded_files(legs["root"] / "three" / "checkpoints" / "step_000012" / "dense", 3)
    assert all(g == {"save": 0, "load": 0} for g in legs["gathers"]), legs["gathers"]


def test_resumes_across_world_sizes_and_sharding_continue_the_reference(legs):
    root, reference = legs["root"], legs["reference"]
    _assert_continues(root / "three_to_two", reference, 2 * EVERY + 1)  # 3 -> 2, fsdp -> fsdp
    _assert_continues(root / "one_to_two", reference, 2 * EVERY + 1)  # 1 -> 2, replicate -> fsdp
    _assert_continues(root / "back", reference, 2 * EVERY + 1)  # 3 -> 1, fsdp -> replicate


def test_one_process_reads_a_sharded_checkpoint_whole(legs):
    """What export and the drift analysis do: no process group, full tensors from the 3 ranks' shards,
    equal to the replicated reference's at the same step."""
    from dynmoe_dist.train.checkpoint import read_checkpoint_dense

    root = legs["root"]
    sharded = read_checkpoint_dense(root / "three" / "checkpoints" / "step_000012")
    replicated = read_checkpoint_dense(root / "reference" / "checkpoints" / "step_000012")
    assert sorted(sharded) == sorted(replicated) and not any(k.startswith(("param/", "adam/")) for k in sharded)
    for name, value in replicated.items():
        assert sharded[name].shape == value.shape and sharded[name].dtype == torch.float64, name
        torch.testing.assert_close(sharded[name], value, rtol=1e-9, atol=1e-12, msg=name)
