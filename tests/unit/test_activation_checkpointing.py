"""train.activation_checkpointing = "block": the same gradients as without it (float64, 1e-12), and the
routing statistics count every token once although each block's forward runs twice."""

import pytest
import torch
import torch.nn as nn

from dynmoe_dist.config import load_config
from dynmoe_dist.moe.layer import MoELayer
from dynmoe_dist.parallel.blocks import apply_activation_checkpointing, find_blocks
from dynmoe_dist.train.loop import Trainer
from dynmoe_dist.train.step import StepTotals, forward_backward


def _trainer(ac: str) -> Trainer:
    config = load_config(
        None,
        [
            "train.precision='float64'",
            "train.global_batch_size=8",
            "task.num_samples=64",
            "task.max_len=8",
            "model.dim=16",
            "model.num_heads=2",
            "model.ffn_dim=24",
            "model.num_layers=2",
            "model.moe_layers=[0, 1]",
            "moe.num_experts=4",
            f"train.activation_checkpointing='{ac}'",
            "output.progress=false",
        ],
    )
    return Trainer(config)


def _one_backward(trainer: Trainer, monkeypatch):
    forwards = []
    original = MoELayer.forward

    def counted(self, x):  # every MoE forward, the replays in the backward pass included
        forwards.append(1)
        return original(self, x)

    monkeypatch.setattr(MoELayer, "forward", counted)
    trainer.recorders.reset_step()
    trainer.recorders.start_window()
    batch = trainer.micro_batch(trainer.schedule.micro_indices(0, 0))
    forward_backward(trainer.model, batch, trainer.task.loss_terms, 1, StepTotals(trainer.groups.device))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    windows = [w.to_flat() for w in trainer.recorders.windows()]
    monkeypatch.undo()
    return grads, trainer.recorders.step_vector(), windows, len(forwards)


def test_gradients_and_statistics_equal_the_run_without_it(monkeypatch):
    plain, checkpointed = _one_backward(_trainer("none"), monkeypatch), _one_backward(_trainer("block"), monkeypatch)
    assert plain[0].keys() == checkpointed[0].keys() and len(plain[0]) > 0
    for name, grad in plain[0].items():
        torch.testing.assert_close(checkpointed[0][name], grad, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(checkpointed[1], plain[1], rtol=0, atol=0)  # tokens, k sum, counts per expert
    for got, want in zip(checkpointed[2], plain[2]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (plain[3], checkpointed[3]) == (2, 4), "each MoE layer runs twice under checkpointing, once without"


def test_parameter_names_do_not_change():
    assert [n for n, _ in _trainer("block").model.named_parameters()] == [
        n for n, _ in _trainer("none").model.named_parameters()
    ]


def test_a_model_without_blocks_is_refused():
    assert find_blocks(nn.Sequential(nn.Linear(2, 2))) == []
    with pytest.raises(ValueError, match=r"train.activation_checkpointing \('block'\).*Linear"):
        apply_activation_checkpointing(nn.Linear(2, 2))


def test_fsdp_on_one_rank_warns_and_trains_plainly():
    from dynmoe_dist.parallel.fsdp import plan_sharding
    from dynmoe_dist.parallel.groups import single_process

    config = load_config(None, ["parallel.dense_sharding='fsdp'", "parallel.expert_sharding='fsdp'"])
    with pytest.warns(UserWarning, match="world of 1 rank"):
        sharding = plan_sharding(config.parallel, single_process(), bf16=False)
    assert not (sharding.dense or sharding.experts)
