"""A run with ``[lora]`` (lora.enabled): an imported Qwen3-MoE (and an upcycled LLaMA) trained through the
Trainer changes its adapters and nothing else (routers included, whose resizes keep them frozen), the optimizer
holds state for the adapters only, a run stopped at a checkpoint resumes with the uninterrupted run's losses,
and bad [lora] options fail at start-up in one line."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import hf_settings, moe_run_settings, save_moe_run_files, train_recorded, write_tiny_run  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.moe import MoEConfig  # noqa: E402
from dynmoe_dist.moe.layer import NativeRouter  # noqa: E402
from dynmoe_dist.moe.routing import NativeRule  # noqa: E402

LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora"), "qwen3_moe", 8)


def trainer(root, *extra, out="out"):
    from dynmoe_dist.train.loop import Trainer

    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", 1, *extra, steps=6, batch=7)
    return Trainer(load_config(None, [*settings, f"output.out_dir='{root / out}'"]))


def test_a_lora_run_trains_the_adapters_only(root):
    run = trainer(root, *LORA)
    model = run.parts.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapters = {name for name in before if ".lora_" in name}
    assert any(".experts.experts.7.lora_a_in" in n for n in adapters) and any("q_proj.lora_a" in n for n in adapters)
    _, losses, _, _ = train_recorded(run, 4)
    assert all(loss == loss for loss in losses)  # finite: no NaN
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())}
    assert changed == adapters
    assert {id(p) for p in run.parts.optimizer.state} == {id(p) for n, p in model.named_parameters() if n in adapters}


def test_an_upcycled_model_trains_its_adapters_through_events(tmp_path):
    """The tiny LLaMA upcycled in blocks 1 and 2 (top-any, events every 3 steps): the copies of its MLPs get their
    adapters, events remove and add experts (a new one copied with its adapters), and only adapters train; the
    routers change only by the events' resizes."""
    from dynmoe_dist.train.loop import Trainer

    settings = [s for s in hf_settings(*write_tiny_run(tmp_path), steps=6) if not s.startswith("model.freeze")]
    run = Trainer(load_config(None, [*settings, *LORA, f"output.out_dir='{tmp_path / 'out'}'"]))
    model = run.parts.model
    before = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" not in name}
    _, _, _, events = train_recorded(run, 6)
    assert events, "the run must remove or add experts"
    for name, p in model.named_parameters():
        assert p.requires_grad == (".lora_" in name), name
        if name in before and ".router." not in name:
            assert torch.equal(before[name], p.detach()), name
    assert all(p.requires_grad for p in run.parts.optimizer.state)


def losses_to_the_end(root, out, save_at=None, resume=""):
    """step -> loss of a LoRA run to its last step (resumed from ``resume`` first; saved after ``save_at`` steps)."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.run import adaptive_controller, step_once

    run = trainer(root, *LORA, f"output.resume='{resume}'", out=out)
    adaptive = adaptive_controller(run, CollectiveCoordinator(run.groups))
    checkpoints = run.checkpoint_manager(adaptive)
    if resume:
        checkpoints.resume(resume)
    losses, saved = {}, ""
    while run.step < 6:
        record, _ = step_once(run, adaptive, [])
        losses[record["step"]] = record["loss"]
        if run.step == save_at:
            saved = str(checkpoints.save(run.step))
    return losses, saved


def test_a_lora_run_resumes_exactly(root):
    whole, saved = losses_to_the_end(root, "whole", save_at=3)
    resumed, _ = losses_to_the_end(root, "resumed", resume=saved)
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)


def test_a_bad_lora_target_fails_at_start(root):
    with pytest.raises(ValueError, match=r"lora.targets entry \('shared_experts'\) names nothing in this model"):
        trainer(root, "lora.enabled=true", "lora.targets=['shared_experts']")


def test_a_router_resize_keeps_it_frozen():
    router = NativeRouter(MoEConfig(dim=4, num_experts=4, router="native"), NativeRule(top_k=2, router_bias=True))
    router.requires_grad_(False)
    router.resize([0, 2], torch.zeros(1, 4))
    assert not router.weight.requires_grad and not router.bias.requires_grad
