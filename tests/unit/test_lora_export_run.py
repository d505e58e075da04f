"""``python -m dynmoe_dist.export`` of a LoRA run (lora.enabled) trained through the Trainer on the tiny Qwen3-MoE
(float64): by default merged in the stock format, which plain transformers loads with the run's logits; with
``--adapter`` a PEFT adapter directory PEFT loads onto the base with the run's logits (a run whose experts did
not change; also DeepSeek-V3 with every target, its dense first MLP and shared experts, and gpt-oss); a top-any
run (routers converted) gets a one-line note and the merged remote-code model; an adapter against a base whose
content changed is a one-line error."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import NUM_EXPERTS, moe_run_settings, save_moe_checkpoint, save_moe_run_files  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.export import main  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402

BASE = "qwen3_moe"  # root/qwen3_moe: the base every run starts from
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=12")
LORA = ("lora.enabled=true", "lora.rank=2", "lora.alpha=4.0", "lora.targets=['attention', 'routed_experts']")


def trained(root, name, *extra, base=BASE):
    """(the Trainer after 4 steps, its checkpoint) of a LoRA run on the base at root/``base``."""
    from dynmoe_dist.train.loop import Trainer
    from dynmoe_dist.train.run import run

    settings = moe_run_settings(root / base, root / "corpus.txt", 1, *LORA, *extra, steps=4, batch=7)
    config = load_config(None, [*settings, f"output.out_dir='{root / name}'"])
    trainer = Trainer(config)
    run(config, trainer)
    return trainer, next((root / name / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora_export"), BASE, NUM_EXPERTS)


@pytest.fixture(scope="module")
def steady(root):
    return trained(root, "steady", "adaptive.enabled=false")


IDS = torch.randint(2, 8, (2, 7), generator=torch.Generator().manual_seed(3))  # inside the word-level vocabulary


def logits(model):
    model.eval()
    with torch.no_grad(), collect_aux_losses():
        return model(input_ids=IDS).logits


def load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), experts_implementation="eager", dtype=torch.float64)


def export_cli(checkpoint, out, *flags, capsys):
    main([str(checkpoint), "--out", str(out), *flags])
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_merged_by_default(root, steady, tmp_path, capsys):
    trainer, checkpoint = steady
    expected = logits(trainer.model)
    assert (expected - logits(load(root / BASE))).abs().max() > 1e-4  # the adapters trained
    printed, _ = export_cli(checkpoint, tmp_path / "merged", capsys=capsys)
    assert "model.safetensors" in printed["files"] and "adapter_config.json" not in printed["files"]
    torch.testing.assert_close(logits(load(tmp_path / "merged")), expected, rtol=0, atol=1e-10)


def test_adapter_loads_onto_the_base(root, steady, tmp_path, capsys):
    from peft import PeftModel

    trainer, checkpoint = steady
    printed, err = export_cli(checkpoint, tmp_path / "adapter", "--adapter", capsys=capsys)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(printed["files"]) and "note:" not in err
    loaded = PeftModel.from_pretrained(load(root / BASE), str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "family, targets, adapted",
    [
        ("deepseek_v3", "['attention', 'dense_mlp', 'routed_experts', 'shared_experts']", "shared_experts.up_proj"),
        ("gpt_oss", "['attention', 'routed_experts']", "experts.gate_up_proj"),  # gate and up interleaved
    ],
)
def test_the_adapter_of_another_family_loads_onto_its_base(root, family, targets, adapted, tmp_path, capsys):
    from peft import PeftModel

    save_moe_checkpoint(family, root / family)
    trainer, checkpoint = trained(root, family, "adaptive.enabled=false", f"lora.targets={targets}", base=family)
    printed, err = export_cli(checkpoint, tmp_path / "adapter", "--adapter", capsys=capsys)
    assert "adapter_model.safetensors" in printed["files"] and "note:" not in err
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert any(adapted in name for name in config["target_parameters"])
    loaded = PeftModel.from_pretrained(load(root / family), str(tmp_path / "adapter"))
    assert (logits(loaded) - logits(load(root / family))).abs().max() > 1e-4  # the adapters trained
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=0, atol=1e-10)


def test_a_top_any_run_gets_the_merged_remote_code_model_and_a_note(root, tmp_path, capsys):
    """Converted routers: the unmerged adapter is refused in one note and the merged model is written with remote
    code, which transformers loads (trust_remote_code) with the run's logits."""
    from transformers import AutoModelForCausalLM

    trainer, checkpoint = trained(root, "top_any", *TOP_ANY)
    printed, err = export_cli(checkpoint, tmp_path / "out", "--adapter", capsys=capsys)
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "unchanged base" in notes[0] and "converted to 'top_any'" in notes[0]
    assert notes[0].endswith("writing the merged model instead")
    assert "modeling_dynmoe.py" in printed["files"] and "adapter_config.json" not in printed["files"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dynmoe"]["moe"]["adapter_rank"] == 0  # the plain model: no adapters to build
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float64)
    torch.testing.assert_close(logits(merged), logits(trainer.model), rtol=0, atol=1e-10)


def test_an_adapter_against_a_changed_base_is_one_line(root, steady):
    from dynmoe_dist.train.checkpoint import read_checkpoint_meta
    from dynmoe_dist.train.model_files import checked_base

    entry = read_checkpoint_meta(steady[1])[0]["states"]["model"]
    checked_base(entry, str(root / BASE))  # the base the run was trained from
    changed = {"base": {**entry["base"], "digest": "0" * 32}}
    with pytest.raises(ValueError, match=r"model.path \(.*qwen3_moe'\) has content \w+; .* with content 0{32}") as err:
        checked_base(changed, str(root / BASE))
    assert "\n" not in str(err.value)


def test_an_adapter_of_a_run_without_lora_is_one_line(root, tmp_path):
    from dynmoe_dist.export import export

    _, checkpoint = trained(root, "plain", "adaptive.enabled=false", "lora.enabled=false")
    with pytest.raises(ValueError, match=r"^--adapter: CHECKPOINT \(.*\) is no LoRA run \(lora.enabled is false\)$"):
        export(checkpoint, tmp_path / "x", progress=False, adapter=True)
