"""Export a trained tiny LLaMA checkpoint to a transformers directory, load it back, generate with it.

The run adds experts (sparse initial gates + short adaptive periods), so the export must rebuild the
checkpoint's expert counts, not the config's num_experts."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import NUM_LAYERS, corpus_lines, save_llama, save_tokenizer  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.data.tokenizers import load_tokenizer  # noqa: E402
from dynmoe_dist.export import export, main  # noqa: E402
from dynmoe_dist.hf import MoEBlock, from_pretrained, moe_blocks  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import run

    root = tmp_path_factory.mktemp("export")
    model_dir, out_dir = root / "model", root / "run"
    save_llama(model_dir, save_tokenizer(model_dir))
    (root / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    config = load_config(
        None,
        [
            "task.name='causal-lm'",
            f"task.path='{root / 'corpus.txt'}'",
            f"task.tokenizer='{model_dir}'",
            "task.max_len=8",
            "model.source='hf'",
            f"model.path='{model_dir}'",
            f"model.num_layers={NUM_LAYERS}",
            "model.moe_layers=[0, 2]",
            "moe.num_experts=2",
            "moe.threshold_init=0.5",
            "train.max_steps=4",
            "train.global_batch_size=6",
            "train.lr=0.01",
            "adaptive.period_steps=2",
            f"output.out_dir='{out_dir}'",
            "output.progress=false",
            "output.tensorboard=false",
            "output.report=false",
        ],
    )
    trainer = Trainer(config)
    final = run(config, trainer)
    checkpoint = next((out_dir / "checkpoints").glob("step_*"))
    return trainer, final, checkpoint, root


def test_export_round_trip_equals_the_trained_model(trained, tmp_path):
    trainer, final, checkpoint, _ = trained
    counts = [layer.num_experts for layer in trainer.moe_layers]
    assert counts != [2, 2], "the run was meant to add experts"
    out = export(checkpoint, tmp_path / "exported")
    assert {"config.json", "model.safetensors", "tokenizer.json", "modeling_dynmoe.py"} <= {
        p.name for p in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "dynmoe_llama" and config["architectures"] == ["DynMoELlamaForCausalLM"]
    section = config["dynmoe"]
    assert section["moe_blocks"] == [0, 2] and section["num_experts"] == counts
    assert section["moe"]["eval_k0"] == "top1" and len(section["thresholds"][0]) == counts[0]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    want = {f"model.layers.2.mlp.moe.experts.experts.{e}.w_gate" for e in range(counts[1])}
    assert want <= keys and "model.layers.2.mlp.moe.router.threshold" in keys
    model = from_pretrained(out)
    assert [m.num_experts for _, m in find_moe_layers(model)] == counts
    ids = torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_plain_transformers_loads_the_export_of_a_trained_run(trained, tmp_path):
    """The CLI's export of a run that added experts, loaded where dynmoe_dist cannot be imported."""
    from hf_remote_cases import run_remote_check

    trainer, _, checkpoint, _ = trained
    out = export(checkpoint, tmp_path / "exported")
    ids = torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(0))
    result = run_remote_check(tmp_path, {"cases": [{"dir": str(out), "ids": ids.tolist()}]})
    got = result["cases"][0]
    assert result["blocked"] and got["class"] == "DynMoELlamaForCausalLM"
    assert got["keys"]["missing_keys"] == [] and got["keys"]["unexpected_keys"] == []
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], trainer.model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_generate_is_greedy_next_token(trained, tmp_path):
    out = export(trained[2], tmp_path / "exported")
    model, tokenizer = from_pretrained(out), load_tokenizer(str(out))
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    # reference: full forward over the growing sequence, argmax of the last position (no KV cache)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == ids.tolist()
    assert generated.shape[1] == prompt.shape[1] + 6


def test_eval_k0_skip_applies_at_inference(trained, tmp_path):
    out = export(trained[2], tmp_path / "exported")
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    top1, skip = from_pretrained(out), from_pretrained(out, eval_k0="skip")
    for model in (top1, skip):
        for _, layer in find_moe_layers(model):
            layer.router.threshold.data.fill_(2.0)  # cos <= 1 < 2: no token selects any expert
    # skip: every MoE block outputs 0, i.e. the model with those MLPs removed
    zeroed = from_pretrained(out, eval_k0="skip")
    for block in moe_blocks(zeroed):
        block.forward = lambda x: torch.zeros_like(x)
    with torch.no_grad():
        got_skip, got_top1, want = (m(input_ids=ids).logits for m in (skip, top1, zeroed))
    torch.testing.assert_close(got_skip, want, rtol=0, atol=0)
    assert (got_top1 - want).abs().max() > 1e-3  # top1 still runs one expert per token
    assert all(isinstance(b, MoEBlock) for b in moe_blocks(skip))


def test_export_rejects_a_non_checkpoint_and_a_builtin_run(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"CHECKPOINT \('.*'\) is not a checkpoint directory"):
        export(tmp_path, tmp_path / "out")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert "is not a checkpoint directory" in capsys.readouterr().err
    from dynmoe_dist.train.checkpoint import FORMAT
    from dynmoe_dist.train.checkpoint_parts import atomic_save

    config = load_config(None, [])
    meta = {"format": FORMAT, "step": 1, "config": json.dumps(config.to_dict(), default=list), "states": {}}
    atomic_save(meta, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"model.source \('builtin'\); only 'hf' runs export"):
        export(tmp_path, tmp_path / "out")


def test_resume_restores_the_grown_model(trained):
    from dynmoe_dist.train.loop import Trainer

    trainer, _, checkpoint, _ = trained
    fresh = Trainer(trainer.config)  # built with moe.num_experts = 2 per layer
    fresh.checkpoint_manager().resume(str(checkpoint))
    assert [m.num_experts for m in fresh.moe_layers] == [m.num_experts for m in trainer.moe_layers]
    assert fresh.step == trainer.step
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(2))
    fresh.model.eval(), trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, rtol=0, atol=0
        )


def test_export_shows_a_bar_over_its_stages(trained, tmp_path, capsys, monkeypatch):
    import re

    from dynmoe_dist.export import EXPORT_STAGES
    from dynmoe_dist.train import progress

    monkeypatch.setattr(progress, "LOG_FILE_REDRAW_S", 0.0)  # pytest's stderr is no terminal: draw every advance
    monkeypatch.setattr(progress, "WAIT_SHOWN_AFTER_S", 0.0)
    export(trained[2], tmp_path / "exported")
    lines = [line for line in re.split(r"[\r\n]", capsys.readouterr().err) if line.startswith("exporting step_")]
    drawn = [int(n) for line in lines for n in re.findall(rf"(\d+)/{EXPORT_STAGES}\b", line)]
    assert sorted(set(drawn)) == list(range(EXPORT_STAGES + 1)) and drawn == sorted(drawn)
    export(trained[2], tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
