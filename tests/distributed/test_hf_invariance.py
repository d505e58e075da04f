"""An upcycled Hugging Face causal LM (tiny LLaMA, gated experts) trains the same on 1, 2 and 3 ranks
(expert parallelism over all of them) through adaptive events that remove and add experts: float64
per-step losses agree to 1e-9, expert counts and events are equal at every step. The checkpoints are
keyed by logical expert id: exported, the 1-, 2- and 3-rank runs are the same transformers model, and the
3-rank export computes the logits the trained 3-rank model computed (1e-6).

Each world's group is spawned once for the module (one run_simulated call returns everything)."""

import functools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import STEPS, hf_settings, train_recorded, write_tiny_run  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402
from dynmoe_dist.train.checkpoint_parts import read_expert_file  # noqa: E402


def probe_ids():
    return torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(0))


def hf_worker(model_dir, text_file, out_dir, world):
    from dynmoe_dist.train.loop import Trainer

    config = load_config(
        None, hf_settings(model_dir, text_file) + [f"parallel.ep_size={world}", f"output.out_dir='{out_dir}'"]
    )
    trainer = Trainer(config)
    adaptive, losses, counts, events = train_recorded(trainer, STEPS)
    checkpoint = trainer.checkpoint_manager(adaptive).save(trainer.step)
    test_loss = trainer.evaluate()["test_loss"]
    trainer.model.eval()
    with torch.no_grad():  # every rank runs the same input: the expert-parallel forward, in eval mode
        logits = trainer.model(input_ids=probe_ids()).logits
    return dict(
        losses=losses,
        counts=counts,
        events=events,
        test_loss=test_loss,
        logits=logits,
        checkpoint=str(checkpoint) if checkpoint else None,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_tiny_run(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@functools.lru_cache(maxsize=None)
def _cluster(world, model_dir, text_file, runs):
    args = (model_dir, text_file, f"{runs}/w{world}", world)
    if world == 1:
        return [hf_worker(*args)]
    return run_simulated(hf_worker, world, args=args, timeout_s=300)


@pytest.fixture(scope="module")
def reference(files, runs_dir):
    return _cluster(1, *files, str(runs_dir))[0]


@pytest.fixture(scope="module", params=[2, 3])
def world(request, files, runs_dir):
    return request.param, _cluster(request.param, *files, str(runs_dir))


def test_reference_removes_and_adds_experts(reference):
    events = reference["events"]
    assert any(removed for _, _, removed, _, _ in events), events
    assert any(added for _, _, _, added, _ in events), events
    assert min(min(c) for c in reference["counts"]) >= 3  # ep 3 needs one expert per rank
    assert len({tuple(c) for c in reference["counts"]}) > 1, "expert counts never changed"


def test_same_losses_and_expert_counts_on_two_and_three_ranks(world, reference):
    size, results = world
    for rank, got in enumerate(results):
        assert got["counts"] == reference["counts"], f"world {size} rank {rank}"
        assert got["events"] == reference["events"], f"world {size} rank {rank}"
        for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
            assert abs(a - b) <= 1e-9 * abs(b), f"world {size} rank {rank} step {step}: {a} vs {b}"
        assert abs(got["test_loss"] - reference["test_loss"]) <= 1e-9 * reference["test_loss"]
        torch.testing.assert_close(got["logits"], reference["logits"], rtol=0, atol=1e-9)


def test_checkpoint_holds_each_logical_expert_once(world, reference):
    size, results = world
    step_dir = results[0]["checkpoint"]
    experts = {}
    for r in range(size):
        part = read_expert_file(Path(step_dir), r)
        assert not set(part) & set(experts), "an expert saved by two ranks"
        experts.update(part)
    final = reference["counts"][-1]
    assert sorted(experts) == sorted(f"{layer}/{e}" for layer in range(2) for e in range(final[layer]))
    assert sorted(experts["0/0"]["params"]) == ["w_gate", "w_in", "w_out"]


def test_exports_of_every_world_are_the_same_model(world, reference, tmp_path):
    from dynmoe_dist.export import export
    from dynmoe_dist.hf import from_pretrained

    size, results = world
    one, other = (
        from_pretrained(export(c, tmp_path / f"x{i}"))
        for i, c in enumerate((reference["checkpoint"], results[0]["checkpoint"]))
    )
    with torch.no_grad():
        a, b = one(input_ids=probe_ids()).logits, other(input_ids=probe_ids()).logits
    assert a.dtype == torch.float64
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_three_rank_round_trip_equals_the_trained_model(files, runs_dir, tmp_path):
    """3 ranks, experts removed and added: export -> from_pretrained computes the trained model's logits."""
    from dynmoe_dist.data.tokenizers import load_tokenizer
    from dynmoe_dist.export import export
    from dynmoe_dist.hf import from_pretrained, moe_blocks

    results = _cluster(3, *files, str(runs_dir))
    out = export(results[0]["checkpoint"], tmp_path / "exported")
    model = from_pretrained(out)
    assert [block.moe.num_experts for block in moe_blocks(model)] == results[0]["counts"][-1]
    with torch.no_grad():
        got = model(input_ids=probe_ids()).logits
    torch.testing.assert_close(got, results[0]["logits"], rtol=0, atol=1e-6)
    # greedy generation of the exported model is deterministic
    tokenizer = load_tokenizer(str(out))
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    first, second = (
        model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id) for _ in range(2)
    )
    assert first.tolist() == second.tolist() and first.shape[1] == prompt.shape[1] + 5
