"""An imported MoE trained with its own routing on 2 ranks (experts split between them, re-placed at the
events) goes back out in its stock format: `python -m dynmoe_dist.export` writes what save_pretrained
writes, plain transformers loads it WITHOUT trust_remote_code, and its logits are the trained model's
(the one-process run of the same config, float64: 1e-6)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from hf_tiny import corpus_lines, moe_run_settings, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402


def settings(root, out_dir, world, *extra):
    return moe_run_settings(root / "model", root / "corpus.txt", world, f"output.out_dir='{out_dir}'", *extra)


def train(root, out_dir, world, *extra):
    from dynmoe_dist.train.run import run

    run(load_config(None, settings(root, out_dir, world, *extra)))


def test_the_stock_export_of_a_two_rank_run_is_the_trained_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.export import export
    from dynmoe_dist.train.checkpoint import complete_checkpoints
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import run

    _, vocab = save_moe_checkpoint("qwen3_moe", tmp_path / "model", num_experts=8)
    (tmp_path / "corpus.txt").write_text("\n".join(corpus_lines(60, 3)) + "\n")
    config = load_config(None, settings(tmp_path, tmp_path / "one", 1))
    reference = Trainer(config)
    run(config, trainer=reference)
    run_simulated(train, 2, args=(tmp_path, tmp_path / "two", 2), timeout_s=600)

    out = export(complete_checkpoints(str(tmp_path / "two"))[-1], tmp_path / "stock")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and "auto_map" not in saved  # the stock class, no remote code
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64, experts_implementation="eager")
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM" and theirs.config.num_experts == 8
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference.model.eval()(ids).logits
        got = theirs.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got - theirs.eval()(input_ids=ids).logits).abs().max() == 0  # deterministic
    before = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "model"), dtype=torch.float64, experts_implementation="eager"
    )
    assert (before.eval()(input_ids=ids).logits - got).abs().max() > 1e-3  # it did train


TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=12", "moe.combine='softmax'")


def test_a_top_any_conversion_exports_as_remote_code_with_its_grown_and_pruned_experts(tmp_path):
    """Converted to top-any (calibrated to k = 1, softmax combine), trained on 2 ranks with events that remove
    and add experts: the export is the remote-code directory, and transformers (trust_remote_code) computes
    the one-process run's logits."""
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.export import export
    from dynmoe_dist.train.checkpoint import complete_checkpoints
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import run

    _, vocab = save_moe_checkpoint("olmoe", tmp_path / "model", num_experts=8)
    (tmp_path / "corpus.txt").write_text("\n".join(corpus_lines(60, 3)) + "\n")
    config = load_config(None, settings(tmp_path, tmp_path / "one", 1, *TOP_ANY))
    reference = Trainer(config)
    run(config, trainer=reference)
    counts = [layer.num_experts for layer in reference.moe_layers]
    assert counts != [8] * len(counts), "the run must remove or add experts"
    run_simulated(train, 2, args=(tmp_path, tmp_path / "two", 2, *TOP_ANY), timeout_s=600)

    out = export(complete_checkpoints(str(tmp_path / "two"))[-1], tmp_path / "remote")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "dynmoe_olmoe" and saved["dynmoe"]["num_experts"] == counts
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64, trust_remote_code=True)
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference.model.eval()(ids).logits
        got = theirs.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
