"""An upcycled Hugging Face causal LM trains the same on 1 and 2 ranks (expert parallelism over both):
float64 per-step losses agree to 1e-9, and a checkpoint keyed by logical expert id holds gated experts."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hf_tiny import NUM_LAYERS, corpus_lines, save_llama, save_tokenizer  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS = 4


def _config(model_dir, text_file, out_dir, world):
    return load_config(None, [
        "task.name='causal-lm'", f"task.path='{text_file}'", f"task.tokenizer='{model_dir}'", "task.max_len=8",
        "model.source='hf'", f"model.path='{model_dir}'", f"model.num_layers={NUM_LAYERS}", "model.moe_layers=[1, 2]",
        "model.freeze=['model.embed_tokens', 'model.layers.0']",
        "moe.num_experts=4", f"parallel.ep_size={world}", "train.precision='float64'", f"train.max_steps={STEPS}",
        "train.global_batch_size=6", "train.lr=0.01", "train.warmup_steps=1", "adaptive.enabled=false",
        f"output.out_dir='{out_dir}'", "output.progress=false", "output.tensorboard=false", "output.report=false"])


def losses_worker(model_dir, text_file, out_dir, world):
    from dynmoe_dist.train.checkpoint import CheckpointManager
    from dynmoe_dist.train.loop import Trainer
    trainer = Trainer(_config(model_dir, text_file, out_dir, world))
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    CheckpointManager(trainer).save()
    return losses, trainer.evaluate()["test_loss"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_llama")
    save_llama(model_dir, save_tokenizer(model_dir))
    text_file = tmp_path_factory.mktemp("text") / "corpus.txt"
    text_file.write_text("\n".join(corpus_lines()) + "\n")
    return str(model_dir), str(text_file)


def test_same_losses_on_one_and_two_ranks(files, tmp_path):
    import torch
    ref_losses, ref_test = losses_worker(*files, str(tmp_path / "one"), 1)
    results = run_simulated(losses_worker, 2, args=(*files, str(tmp_path / "two"), 2), timeout_s=300)
    for losses, test_loss in results:
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: {got} vs {want}"
        assert abs(test_loss - ref_test) <= 1e-9 * ref_test
    # the 2-rank checkpoint: each logical expert once, with the gated expert's parameters
    step_dir = next((tmp_path / "two" / "checkpoints").glob("step_*"))
    experts = {}
    for r in range(2):
        experts.update(torch.load(step_dir / f"experts_ep{r}.pt", weights_only=False))
    assert sorted(experts) == [f"{layer}/{e}" for layer in range(2) for e in range(4)]
    assert sorted(experts["0/0"]["params"]) == ["w_gate", "w_in", "w_out"]
    # exported, the 2-rank checkpoint is the same model as the 1-rank one (ranks and ep size folded away)
    from dynmoe_dist.export import export
    from dynmoe_dist.hf import from_pretrained
    one, two = (from_pretrained(export(next((tmp_path / name / "checkpoints").glob("step_*")), tmp_path / f"x_{name}"))
                for name in ("one", "two"))
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = one(input_ids=ids).logits, two(input_ids=ids).logits
    assert a.dtype == torch.float64
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
