"""Bad input fails clearly on every rank before any data collective; a silent rank becomes an error
that names the collective instead of a hang."""

import re
import time

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated

BASE = [
    "task.num_samples=200",
    "task.max_len=8",
    "model.dim=16",
    "model.num_heads=2",
    "model.ffn_dim=16",
    "train.max_steps=2",
    "train.global_batch_size=8",
    "adaptive.enabled=false",
]

CASES = {
    "ep_size": (["parallel.ep_size=3"], r"parallel.ep_size \(3\) does not divide the world size \(4\)"),
    "experts": (["moe.num_experts=3", "moe.min_experts=1"], r"num_experts \(3\) < ep_size \(4\)"),
    "batch": (["train.global_batch_size=6", "train.grad_accum=2"], r"micro-batch size \(3 .*\) < world size \(4\)"),
    "mismatch": (None, r"config hash differs across ranks"),
}


def _trainer_error(overrides):
    from dynmoe_dist.train.loop import Trainer

    try:
        Trainer(load_config(None, BASE + overrides))
    except ValueError as err:
        return str(err)
    return None


def bad_input_worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    errors = {}
    for name, (overrides, _) in CASES.items():
        if overrides is None:  # every rank but rank 1 uses the default learning rate
            overrides = ["train.lr=0.5"] if rank == 1 else []
        errors[name] = _trainer_error(overrides)
    dist.barrier()  # the group still works after every one of these errors
    return errors


def silent_rank_worker():
    """Rank 1 stalls; rank 0's first training collective must fail with a named, timed-out error."""
    import torch.distributed as dist

    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(load_config(None, BASE + ["parallel.timeout_s=3"]))
    if dist.get_rank() == 1:
        time.sleep(8)
        return None
    started = time.monotonic()
    try:
        trainer.train_step()
    except Exception as err:  # noqa: BLE001 - the point is what it says
        return type(err).__name__, str(err), time.monotonic() - started
    return None


def test_bad_input_errors_on_every_rank():
    results = run_simulated(bad_input_worker, 4, timeout_s=120)
    for name, (_, pattern) in CASES.items():
        for rank, errors in enumerate(results):
            assert errors[name] is not None, f"{name}: rank {rank} raised nothing"
            assert re.search(pattern, errors[name]), f"{name}: rank {rank}: {errors[name]}"


def test_silent_rank_gives_named_timeout():
    results = run_simulated(silent_rank_worker, 2, timeout_s=120, collective_timeout_s=3)
    kind, message, seconds = results[0]
    assert kind == "CollectiveError"
    assert "collective '" in message and "rank 0" in message and "timeout 3s" in message
    assert seconds < 30, message
