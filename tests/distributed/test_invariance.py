"""World-size invariance of training: the same config and seed give the same per-step loss on 1, 2, 3
and 4 ranks, for top_any, top_k and top_p and every ep size that divides the world (float64: 1e-9;
float32: 1e-4 relative over 20 steps)."""

import pytest

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated

STEPS = 20


def _config(router, precision, ep_size, num_experts=5):
    return load_config(
        None,
        [
            f"moe.router='{router}'",
            "moe.top_k=2",
            f"moe.num_experts={num_experts}",
            f"parallel.ep_size={ep_size}",
            f"train.precision='{precision}'",
            f"train.max_steps={STEPS}",
            "train.global_batch_size=14",
            "train.lr=0.003",
            "train.warmup_steps=3",
            "task.num_samples=400",
            "task.max_len=12",
            "model.dim=16",
            "model.num_heads=2",
            "model.ffn_dim=24",
            "model.num_layers=2",
            "model.moe_layers=[0, 1]",
            "adaptive.enabled=false",
        ],
    )


def _runs(world):
    ep_sizes = [ep for ep in range(1, world + 1) if world % ep == 0]
    runs = [("top_any", "float64", ep) for ep in ep_sizes]
    runs += [(router, "float64", world) for router in ("top_k", "top_p")]
    runs += [("top_any", "float32", world)]
    return runs


def train_losses(config):
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(config)
    return [trainer.train_step()["loss"] for _ in range(STEPS)]


def invariance_worker(world):
    return {run: train_losses(_config(*run)) for run in _runs(world)}


@pytest.fixture(scope="module")
def reference():
    runs = {run for world in (2, 3, 4) for run in _runs(world)}
    return {(router, precision): train_losses(_config(router, precision, 1)) for router, precision, _ in runs}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_same_losses_on_any_world_size(world, reference):
    results = run_simulated(invariance_worker, world, args=(world,), timeout_s=300)
    for run, losses in results[0].items():
        router, precision, ep = run
        ref = reference[(router, precision)]
        tol = 1e-9 if precision == "float64" else 1e-4
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= tol * abs(want), (
                f"world={world} ep={ep} {router} {precision} step {step}: {got} vs {want}"
            )
        assert all(r[run] == losses for r in results), "ranks disagree on the logged loss"
