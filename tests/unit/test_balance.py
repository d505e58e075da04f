"""Out-of-gradient controllers (moe/balance.py): the compute budget on top-any thresholds (moe.target_k) and
DeepSeek-V3's auxiliary-loss-free balance (moe.balance = 'bias'): the rules by hand, the routers' choice
bias, and small runs in which the budget holds the mean k and the bias rule lowers the load's spread."""

import pytest
import torch

from dynmoe_dist.moe.balance import (
    MAX_SHIFT,
    UNSET,
    Balancers,
    LayerBalance,
    balance_moves,
    budget_shift,
    cosine_bins,
    measured_slope,
    share_threshold,
)
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.layer import MoELayer
from dynmoe_dist.moe.routing import NativeRule, top_k


def test_the_bias_moves_against_the_load_and_sum_to_zero():
    # loads 6, 2, 0, 4 (mean 3): signs -1, +1, +1, -1 times 0.1, already mean zero
    assert balance_moves(torch.tensor([6.0, 2.0, 0.0, 4.0]), 0.1).tolist() == pytest.approx([-0.1, 0.1, 0.1, -0.1])
    # loads 3, 3, 6 (mean 4): +r, +r, -r, re-centred by r/3 -> 2r/3, 2r/3, -4r/3
    moves = balance_moves(torch.tensor([3.0, 3.0, 6.0]), 0.3)
    assert moves.tolist() == pytest.approx([0.2, 0.2, -0.4]) and moves.sum().item() == pytest.approx(0.0)
    # an even load does not move
    assert balance_moves(torch.tensor([5.0, 5.0]), 0.1).tolist() == [0.0, 0.0]


def test_the_budget_takes_a_damped_newton_step_on_the_measured_slope_plus_its_drift():
    # 0.4 pairs per token within +-0.01 of their thresholds: slope 20; k 2.2 against 2: 0.8 of 0.2/20 = 0.008,
    # and the drift (the integral term) gains a tenth of 0.2/20 = 0.001 and moves with it
    assert measured_slope(0.4) == pytest.approx(20.0)
    assert budget_shift(2.2, 2.0, 20.0) == (pytest.approx(0.009), pytest.approx(0.001))
    assert budget_shift(1.5, 2.0, 20.0, 0.001) == (pytest.approx(-0.0215), pytest.approx(-0.0015))  # too few
    assert budget_shift(2.0, 2.0, 20.0, 0.002) == (0.002, 0.002)  # on target: the drift alone moves
    assert budget_shift(3.0, 2.0, 20.0) == (pytest.approx(0.04), 0.0)  # 50 % off: outside DRIFT_BAND, no drift
    assert budget_shift(2.4, 2.0, 5.0, 0.01) == (MAX_SHIFT, 0.01)  # asks 0.078: MAX_SHIFT, the drift unwound
    assert budget_shift(3.0, 2.0, 0.0) == (MAX_SHIFT, 0.0) and budget_shift(1.0, 2.0, 0.0) == (-MAX_SHIFT, 0.0)
    assert budget_shift(2.0, 2.0, 0.0) == (0.0, 0.0)  # slope unknown, on target


def _followed(fall_per_step, slope_seen, steps=80):
    """A layer whose mean k falls by fall_per_step every step (its gate vectors drifting) while the budget
    (slope misjudged: the true slope is slope_seen times the one the budget divides by) holds target 1: the
    errors k - 1, step by step."""
    true_slope, k, drift, errors = 20.0 * slope_seen, 1.0, 0.0, []
    for _ in range(steps):
        errors.append(k - 1.0)
        shift, drift = budget_shift(k, 1.0, 20.0, drift)
        k += -true_slope * shift - fall_per_step
    return errors


@pytest.mark.parametrize("slope_seen", [0.5, 1.0, 2.0])
def test_the_drift_follows_a_steady_fall_of_k_with_no_standing_error(slope_seen):
    """A steady fall of k (3 % of the target a step) is what the frontier's runs showed at target 1.0. A
    proportional step alone would hold k fall / DAMPING = 3.75 % under the target for as long as the fall
    lasts; with the drift the error dies out, also when the slope is misjudged by 2 times either way."""
    errors = _followed(0.03, slope_seen)
    assert max(abs(e) for e in errors[-20:]) < 1e-3, errors[-20:]
    assert max(abs(e) for e in errors) < 0.2, max(abs(e) for e in errors)


def test_top_k_chooses_by_the_biased_probabilities_and_weighs_by_the_plain_ones():
    # probs 0.5, 0.3, 0.2; a bias of +0.15 on expert 2 makes it outrank expert 1 (0.35 > 0.3): top-2 = {0, 2},
    # weights 0.5 and 0.2 renormalised (5/7, 2/7), the bias in neither
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    routing = top_k(logits, 2, torch.tensor([0.0, 0.0, 0.15]))
    assert routing.mask.tolist() == [[True, False, True]]
    assert routing.weights[0].tolist() == pytest.approx([5 / 7, 0.0, 2 / 7])
    assert top_k(logits, 2).mask.tolist() == [[True, True, False]]  # no bias: the plain top-2


def _counted(layer, x_TD, balance):
    layer.train()
    layer(x_TD)
    return balance.counts.tolist()


def test_a_top_k_layer_moves_its_choice_bias_from_the_summed_counts():
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=4, num_experts=3, router="top_k", top_k=1, balance="bias"))
    with torch.no_grad():  # every token prefers expert 0: counts 5, 0, 0
        layer.router.weight.copy_(torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))
    balance = LayerBalance(layer, layer.config)
    layer.routing_observers.append(balance)
    counts = _counted(layer, torch.ones(5, 4), balance)
    assert counts == [5.0, 0.0, 5.0, 0.0, 0.0]  # tokens, (no budget: no near pairs), counts per expert
    balance.update(counts)
    # mean load 5/3: -r, +r, +r re-centred by r/3: -4r/3, 2r/3, 2r/3 with r = 0.001
    assert layer.router.choice_bias.tolist() == pytest.approx([-0.004 / 3, 0.002 / 3, 0.002 / 3])
    layer.router.resize([2, 0], torch.zeros(1, 4))  # events slice the bias with the experts; a new one starts at 0
    assert layer.router.choice_bias.tolist() == pytest.approx([0.002 / 3, -0.004 / 3, 0.0])


def test_a_deepseek_router_moves_its_correction_bias_and_others_refuse_the_rule():
    rule = NativeRule(top_k=1, scores="sigmoid", correction_bias=True)
    layer = MoELayer(MoEConfig(dim=4, ffn_dim=4, num_experts=2, router="native", balance="bias"), rule=rule)
    with torch.no_grad():
        layer.router.e_score_correction_bias.copy_(torch.tensor([0.5, 0.25]))  # the checkpoint's values
    balance = LayerBalance(layer, layer.config)
    balance.update([4.0, 0.0, 3.0, 1.0])
    # loads 3, 1: -r, +r (mean zero already): the checkpoint's bias moves, its mean stays
    assert layer.router.e_score_correction_bias.tolist() == pytest.approx([0.499, 0.251])
    with pytest.raises(ValueError, match=r"balance \('bias'\) needs choice scores to bias"):
        MoELayer(MoEConfig(dim=4, num_experts=2, router="native", balance="bias"), rule=NativeRule(top_k=1))
    assert Balancers.for_layers([MoELayer(MoEConfig(dim=4, num_experts=2))], MoEConfig(dim=4)) is None  # off


def test_top_any_moves_every_threshold_by_the_budget_and_each_against_its_load():
    config = MoEConfig(dim=2, ffn_dim=4, num_experts=2, target_k=1.0, balance="bias", balance_rate=0.01)
    layer = MoELayer(config)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        layer.router.threshold.zero_()
    balance = LayerBalance(layer, config)
    layer.routing_observers.append(balance)
    # cosines to (1, 0) and (0, 1): token 0 (1, 1): 0.707 both; token 1 (1, -0.005): 1.0 and -0.005 (within 0.01
    # of threshold 0: a near pair); token 2 (1, 0.02): 0.9998 and 0.02 (chosen, not near)
    x_TD = torch.tensor([[1.0, 1.0], [1.0, -0.005], [1.0, 0.02]])
    counts = _counted(layer, x_TD, balance)
    assert counts == [3.0, 1.0, 3.0, 2.0]  # 3 tokens, 1 near pair, expert loads 3 and 2: mean k 5/3
    balance.update(counts)
    # budget: slope 1/3 / 0.02 = 16.7, shift 0.8 * (5/3 - 1) / 16.7 = 0.032 (67 % off: no drift); balance: loads
    # 3, 2 -> +0.01, -0.01
    assert layer.router.threshold.tolist() == pytest.approx([0.032 + 0.01, 0.032 - 0.01])


def test_an_unset_expert_is_placed_where_its_cosines_give_it_its_share():
    # cosines -0.995, 0.005 (bin 100), 0.305, 0.315 (bins 130, 131), 0.995 and 1.0 (both in the top bin, 199)
    hist_B = cosine_bins(torch.tensor([[-0.995], [0.005], [0.305], [0.315], [0.995], [1.0]]))[0]
    assert hist_B.sum() == 6 and [int(hist_B[b]) for b in (0, 100, 130, 131, 199)] == [1, 1, 1, 1, 2]
    # a third of 6 tokens: the two in the top bin, from the lowest edge with no more above it (0.32, bin 132's)
    assert share_threshold(hist_B, 1 / 3) == (pytest.approx(0.32), pytest.approx(2 / 6))
    # a half (3 tokens) cannot be met exactly: the lowest edge with at most 3 above is bin 131's, taking 3
    assert share_threshold(hist_B, 0.5) == (pytest.approx(0.31), pytest.approx(3 / 6))
    assert share_threshold(hist_B, 1.0) == (pytest.approx(-1.0), 1.0)  # every token
    assert share_threshold(hist_B, 0.1) == (1.0, 0.0)  # the top bin alone is more than the share: none


TINY_RUN = [
    "task.num_samples=400",
    "task.max_len=16",
    "model.dim=32",
    "model.num_heads=2",
    "model.ffn_dim=32",
    "model.num_layers=2",
    "model.moe_layers=[0, 1]",
    "moe.num_experts=8",
    "train.precision='float64'",
]
"""Two MoE layers of 8 experts, float64 (a run's batch and steps are its own)."""


def _run(*settings, steps=60, batch=16):
    """A tiny float64 top-any (or top-k) run of two MoE layers of 8 experts: the step records."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer

    base = [*TINY_RUN, f"train.global_batch_size={batch}", f"train.max_steps={steps}"]
    trainer = Trainer(load_config(None, base + list(settings)))
    return [trainer.train_step() for _ in range(steps)]


def _assert_every_window_on_target(records, target_k, after=10, length=10):
    """Every window of `length` steps that starts after `after` steps of warm-up (each step's, not only every
    tenth: a sliding window) has its mean k (tokens of all its steps) within 3 % of the target, in every layer."""
    for start in range(after, len(records) - length + 1):
        for layer in range(len(records[start]["mean_k"])):
            window = [r["mean_k"][layer] for r in records[start : start + length]]  # equal tokens per step
            assert abs(sum(window) / len(window) - target_k) < 0.03 * target_k, (start, layer, window)


@pytest.mark.parametrize("target_k", [1.0, 1.25, 2.0])
def test_the_budget_holds_the_mean_k_within_3_percent_over_every_window(target_k):
    """Top-any starts at k ~ 3.5 (thresholds 0); after 10 steps of warm-up every 10-step window's mean k is
    within 3 % of the target in every layer, and the record says what the controller did. (512 tokens a step:
    one step's k varies by about 5 % with its batch.)"""
    records = _run(f"moe.target_k={target_k}", batch=32)
    assert records[0]["mean_k"][0] > 3 and records[0]["target_k"] == target_k
    assert len(records[0]["threshold_shift"]) == 2 and records[0]["threshold_shift"][0] > 0  # raised at first
    assert len(records[-1]["threshold_drift"]) == 2
    _assert_every_window_on_target(records, target_k)


def test_an_expert_an_event_adds_takes_its_share_of_the_budget_and_k_stays_on_target():
    """Adaptive events with a budget (target_k 1, events after steps 20 and 50): an added expert chooses
    nothing in its first step, is then placed by the budget (no longer UNSET) and takes tokens, and every
    10-step window's mean k after warm-up stays within 3 % of the target. At threshold 0, as without a
    budget, the added gate vector (the mean of the unrouted hidden states) took most tokens: k 1.7 the step
    after the event, the window of steps 21-30 at 1.13, and the kept experts starved."""
    from dynmoe_dist.config import load_config
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import adaptive_controller, step_once

    settings = ["moe.target_k=1.0", "adaptive.enabled=true", "adaptive.period_steps=30", "train.max_steps=60"]
    trainer = Trainer(load_config(None, TINY_RUN + ["train.global_batch_size=32"] + settings))
    adaptive = adaptive_controller(trainer, CollectiveCoordinator(trainer.groups))
    records = [step_once(trainer, adaptive, [])[0] for _ in range(60)]
    after = records[20]  # step 21, the first after the event
    assert after["num_experts"] == [9, 9], "the event added one expert to each layer"
    assert all(load[-1] == 0 for load in after["expert_load"]), "unset, an added expert chooses nothing"
    assert all(max(r["expert_load"][layer][8] for r in records[21:30]) > 0 for layer in range(2))
    assert all(t < UNSET - 0.5 for layer in trainer.moe_layers for t in layer.router.threshold.tolist()), "placed"
    _assert_every_window_on_target(records, 1.0)


def _mean_cv(records):
    return sum(sum(r["load_cv"]) / len(r["load_cv"]) for r in records) / len(records)


def test_the_bias_rule_lowers_the_load_spread_without_an_aux_loss():
    """Top-k without any aux loss: DeepSeek's rule at its default rate brings the load's coefficient of
    variation of the last 30 steps well below the same run's without it. Top-any with a budget: the rule
    lowers it too, and the mean k stays at the budget."""
    plain = _run("moe.router='top_k'", "moe.aux_loss_weight=0")
    biased = _run("moe.router='top_k'", "moe.aux_loss_weight=0", "moe.balance='bias'")
    assert _mean_cv(biased[30:]) < 0.6 * _mean_cv(plain[30:]), (_mean_cv(biased[30:]), _mean_cv(plain[30:]))
    assert max(biased[-1]["bias_spread"]) > 0
    budget = _run("moe.target_k=2.0")
    balanced = _run("moe.target_k=2.0", "moe.balance='bias'", "moe.balance_rate=0.01")
    assert _mean_cv(balanced[30:]) < 0.6 * _mean_cv(budget[30:]), (_mean_cv(balanced[30:]), _mean_cv(budget[30:]))
    k_last = [sum(r["mean_k"]) / 2 for r in balanced[30:]]
    assert abs(sum(k_last) / len(k_last) - 2.0) < 0.06


def test_an_imported_deepseek_v3_runs_its_own_balance_rule_only_when_asked(tmp_path):
    """A tiny DeepSeek-V3 trained with its own routing: by default its e_score_correction_bias stays the
    checkpoint's (transformers' forward never moves it); with moe.balance = 'bias' each step moves it by
    +-balance_rate per expert, re-centred, against the loads summed over the step."""
    from hf_tiny import corpus_lines, moe_run_settings, save_moe_checkpoint

    from dynmoe_dist.config import load_config
    from dynmoe_dist.train.loop import Trainer

    directory, _ = save_moe_checkpoint("deepseek_v3", tmp_path / "ds")
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines(40, 2)) + "\n")
    settings = moe_run_settings(directory, tmp_path / "c.txt", 1, batch=4)

    def biases_after_two_steps(*extra):
        trainer = Trainer(load_config(None, settings + list(extra)))
        before = [layer.router.e_score_correction_bias.clone() for layer in trainer.moe_layers]
        records = [trainer.train_step() for _ in range(2)]
        after = [layer.router.e_score_correction_bias for layer in trainer.moe_layers]
        return before, after, records

    before, after, _ = biases_after_two_steps()
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    before, after, records = biases_after_two_steps("moe.balance='bias'", "moe.balance_rate=0.01")
    for b, a in zip(before, after):
        moved = a - b
        assert moved.abs().max() > 0 and moved.sum().abs() < 1e-9  # moved, its mean kept
        # two steps of +-rate, each re-centred: 4 experts up and 2 down move +r/3... -4r/3, at most 2r a step
        assert moved.abs().max() <= 2 * 2 * 0.01 + 1e-9
    assert len(records[-1]["bias_spread"]) == len(after)
