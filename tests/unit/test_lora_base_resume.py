"""A LoRA run with a low-precision frozen base (float64, the tiny Qwen3-MoE converted to top-any, events after
steps 3 and 6 that add and remove experts) resumes from its checkpoint with the uninterrupted run's losses: a bf16
base saved after an event (its added experts rebuilt from the base's bf16-rounded experts, as the event formed
them), an NF4 base saved before one (its experts re-quantised from model.path as the run quantised them). Its
merged export (the base widened as the run held it, the adapters folded in) loads in transformers with the run's
logits (an NF4 run's when no event formed an expert)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import moe_run_settings, save_moe_run_files, train_saving  # noqa: E402

from dynmoe_dist.export import main  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402

pytest.importorskip("torchao")

LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16", "train.seed=2")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora-base"), "qwen3_moe", 8)


def losses_to_the_end(root, base_dtype, out, *more, save_at=None, resume=""):
    """(step -> loss of the run to step 6, the checkpoint written after ``save_at`` steps, the trainer)."""
    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", 1, *LORA, *TOP_ANY, steps=6, batch=7)
    run, losses, _, saved = train_saving(
        [*settings, f"lora.base_dtype='{base_dtype}'", *more], root / out, 6, save_at=save_at, resume=resume
    )
    return losses, str(saved), run


@pytest.mark.parametrize("base_dtype, save_at", [("bfloat16", 4), ("nf4", 1)])
def test_a_low_precision_run_resumes_exactly(root, base_dtype, save_at):
    whole, saved, _ = losses_to_the_end(root, base_dtype, f"{base_dtype}-whole", save_at=save_at)
    resumed, _, _ = losses_to_the_end(root, base_dtype, f"{base_dtype}-resumed", resume=saved)
    assert sorted(resumed) == list(range(save_at + 1, 7))
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)


@pytest.mark.parametrize("base_dtype, more", [("bfloat16", ()), ("nf4", ("moe.router='native'",))])
def test_the_merged_export_has_the_runs_logits(root, base_dtype, more, tmp_path, capsys):
    """An NF4 run with its native routing (no events): an expert an event forms is re-quantised from its dequantised
    sources, which the export, rebuilding it from the base, does not repeat (within NF4's rounding, not exact)."""
    from transformers import AutoModelForCausalLM

    _, saved, run = losses_to_the_end(root, base_dtype, f"{base_dtype}-export", *more, save_at=6)
    ids = torch.randint(2, 8, (2, 7), generator=torch.Generator().manual_seed(3))
    model = run.parts.model.transformers_model().eval()
    with torch.no_grad(), collect_aux_losses():
        expected = model(input_ids=ids).logits
    main([saved, "--out", str(tmp_path / "merged")])
    assert "model.safetensors" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]
    eager = {"experts_implementation": "eager"} if more else {}  # the stock format: transformers' own experts
    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", trust_remote_code=True, dtype=torch.float64, **eager
    )
    with torch.no_grad(), collect_aux_losses():
        got = merged.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
