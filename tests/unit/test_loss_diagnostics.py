"""experiments losses: checkpoint steps, per-loss router gradients, expert identity across events, and one
tiny end-to-end run."""

import json

import pytest
import torch

from dynmoe_dist.experiments import losses as diag
from dynmoe_dist.experiments.growth import growth_summary, track_experts
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.layer import MoELayer


def test_checkpoint_steps_spread_from_first_to_last():
    assert diag.checkpoint_steps(16, 3) == [0, 8, 15]  # round(0), round(7.5) = 8, round(15)
    assert diag.checkpoint_steps(16, 1) == [15]
    assert diag.checkpoint_steps(2, 5) == [0, 1]
    with pytest.raises(ValueError, match=r"--checkpoints \(0\)"):
        diag.checkpoint_steps(10, 0)


def test_gradient_norms_per_loss():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, aux_losses=("diverse", "simple"))).train()
    routing = layer.router(torch.randn(32, 8), True)
    rows = {r["loss"]: r for r in diag.gradient_norms(layer, routing)}
    assert list(rows) == ["diverse", "simple", "load_balance", "efficiency"]
    assert (rows["diverse"]["on"], rows["efficiency"]["on"]) == (True, False)
    # The gate-vector losses never touch the thresholds; the token losses do, through the STE gates.
    assert rows["diverse"]["threshold_grad_norm"] == rows["simple"]["threshold_grad_norm"] == 0.0
    assert rows["efficiency"]["threshold_grad_norm"] > 0 and rows["load_balance"]["gate_grad_norm"] > 0
    # efficiency = mean_{t,e} g: d/dG_e of sigmoid-relu STE: -sigmoid'(G_e) * (tokens selecting e) / (T E)
    selected_E = routing.mask.sum(dim=0).double()
    expected = (0.25 * selected_E / (32 * 4)).norm().item()  # sigmoid'(0) = 1/4 at G = 0
    assert rows["efficiency"]["threshold_grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert rows["simple"]["value"] == pytest.approx(layer.router.weight.norm(dim=-1).mean().item())


def _event(step, removed, num_added, num_experts, layer=0):
    return {
        "kind": "event",
        "step": step,
        "layer": layer,
        "removed": removed,
        "added": [{"expert": num_experts - num_added + j, "init": "average"} for j in range(num_added)],
        "num_experts": num_experts,
    }


def test_track_experts_replays_positions():
    # 3 experts: init0 init1 init2. Step 10: remove position 1 (init1), add one -> init0 init2 add10.0.
    # Step 20: remove position 2 (add10.0), add one -> init0 init2 add20.0. Step 30: add -> + add30.0.
    events = [_event(20, [2], 1, 3), _event(10, [1], 1, 3), _event(30, [], 1, 4)]  # replayed in step order
    (layer,) = track_experts(events, [3])
    assert layer["final"] == ["init0", "init2", "add20.0", "add30.0"]
    assert [(a["id"], a["removed_step"]) for a in layer["added"]] == [
        ("add10.0", 20),
        ("add20.0", None),
        ("add30.0", None),
    ]
    assert layer["initial_removed"] == 1
    with pytest.raises(ValueError, match="replay gives 3 experts, the record says 5"):
        track_experts([_event(10, [], 0, 5)], [3])


def test_growth_summary_counts_windows_and_triggers():
    windows = [
        {"layer": 0, "num_unrouted": 4, "unrouted_share": 0.01, "added": 1},
        {"layer": 0, "num_unrouted": 0, "unrouted_share": 0.0, "added": 0},
        {"layer": 0, "num_unrouted": 2, "unrouted_share": 0.005, "added": 0},
    ]  # at the cap: no add
    tracked = track_experts([_event(10, [1], 1, 3)], [3])
    (g,) = growth_summary(windows, tracked)
    assert (g["num_windows"], g["windows_with_unrouted"], g["windows_with_add"]) == (3, 2, 1)
    assert (g["trigger_unrouted"], g["trigger_share"], g["num_added"], g["added_later_removed"]) == ([4], [0.01], 1, 0)


def test_losses_end_to_end_tiny(tmp_path):
    argv = [
        "--task",
        "synthetic",
        "--epochs",
        "1",
        "--seeds",
        "0",
        "--models",
        "dynmoe-no-efficiency",
        "--checkpoints",
        "2",
        "--set",
        "task.num_samples=160",
        "--set",
        "model.dim=16",
        "--set",
        "model.ffn_dim=16",
        "--set",
        "train.global_batch_size=16",
        "--out",
        str(tmp_path),
    ]
    result = diag.main(argv)
    (run,) = json.loads((tmp_path / "losses.json").read_text())["runs"]
    assert run["checkpoints"] == [1, 8] and {g["step"] for g in run["gradients"]} == {1, 8}
    assert len(run["gradients"]) == 2 * 2 * 5  # checkpoints x layers x (4 losses + the whole step)
    totals = [g for g in run["gradients"] if g["loss"] == "total"]
    assert len(totals) == 4 and all(g["threshold_grad_norm"] > 0 and g["gate_grad_norm"] > 0 for g in totals)
    assert [len(k) for k in run["mean_k"]] == [8, 8] and len(run["windows"]) == 2  # one window per layer
    assert run["windows"][0]["num_tokens"] > 0 and run["aux_losses"] == ["diverse", "simple", "load_balance"]
    assert 0 <= run["final_accuracy"] <= 100 and f"| {run['final_accuracy']:.2f} |" in result["markdown"]
    assert "efficiency (off)" in result["markdown"] and "| DynMoE, no efficiency | 0 | 1 |" in result["markdown"]
    again = diag.main(argv)  # reuses the finished run
    assert again["runs"][0]["gradients"] == run["gradients"]


def test_whole_step_gradient_is_what_backward_leaves_on_the_router():
    torch.manual_seed(1)
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4)).train()
    probe = diag.LossProbe(1, checkpoints=[0])
    layer.routing_observers.append(lambda lay, x_TD, routing: probe.observe(0, lay, routing))
    out = layer(torch.randn(16, 8))
    (out.output.pow(2).sum() + out.aux_loss).backward()
    total = next(g for g in probe.gradients if g["loss"] == "total")
    assert total["threshold_grad_norm"] == pytest.approx(layer.router.threshold.grad.norm().item())
    assert total["gate_grad_norm"] == pytest.approx(layer.router.weight.grad.norm().item())
    k_T = (out.routing.gates > 0).sum(dim=-1).double()
    over_time = probe.k_over_time()
    assert (over_time["mean_k"], over_time["k0_share"]) == (
        [[pytest.approx(k_T.mean().item())]],
        [[pytest.approx((k_T == 0).double().mean().item())]],
    )
