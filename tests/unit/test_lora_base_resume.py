"""A LoRA run with a low-precision frozen base (float64, the tiny Qwen3-MoE converted to top-any, events after
steps 3 and 6 that add and remove experts) resumes from its checkpoint with the uninterrupted run's losses, bit
for bit: a bf16 or NF4 base saved after an event that formed experts from stored ones (adaptive.expert_init
'reuse_discarded': a copy of the removed expert, remembered as the discarded one too, or the discarded expert
added back; 'average' with fresh adapters; 'most_activated'), an NF4 base saved before one. The rebuilt experts
hold the run's stored bits: an NF4 expert an event formed is re-quantised from its sources' dequantised NF4 as the
event did, not quantised once from the float base (NF4 is not idempotent: that gave other bits). Its merged
export (the base widened as the run held it, the adapters folded in) loads in transformers with the run's logits,
an NF4 run's after events too (one copying an expert an earlier one formed, one adding the discarded back)."""

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
    """(step -> loss of the run to step 6, the checkpoint written after ``save_at`` steps, the trainer, the events'
    expert changes)."""
    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", 1, *LORA, *TOP_ANY, steps=6, batch=7)
    run, losses, events, saved = train_saving(
        [*settings, f"lora.base_dtype='{base_dtype}'", *more], root / out, 6, save_at=save_at, resume=resume
    )
    return losses, str(saved), run, events


# name -> (base dtype, saved after step, more settings); the event after step 3 adds and removes experts
RESUMED = {
    "bfloat16-after-event": ("bfloat16", 4, ()),
    "nf4-before-event": ("nf4", 1, ()),
    "nf4-reused": ("nf4", 4, ()),  # the default 'reuse_discarded': a copy of the removed expert
    "nf4-average": ("nf4", 4, ("adaptive.expert_init='average'", "lora.added_experts='fresh_adapter'")),
    "nf4-most-activated": ("nf4", 4, ("adaptive.expert_init='most_activated'",)),
    # events after steps 2 and 4: the second adds the discarded expert back (copied from its stored bits)
    "nf4-discarded-reused": ("nf4", 4, ("adaptive.period_steps=2",)),
}


@pytest.mark.parametrize("name", RESUMED)
def test_a_low_precision_run_resumes_exactly(root, name):
    base_dtype, save_at, more = RESUMED[name]
    whole, saved, _, events = losses_to_the_end(root, base_dtype, f"{name}-whole", *more, save_at=save_at)
    resumed, _, _, _ = losses_to_the_end(root, base_dtype, f"{name}-resumed", *more, resume=saved)
    assert any(added for step, _, _, added, _ in events if step < save_at) == (save_at > 3), events
    assert sorted(resumed) == list(range(save_at + 1, 7))
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)


EXPORTED = {
    "bfloat16": ("bfloat16", ()),
    "nf4-native": ("nf4", ("moe.router='native'",)),  # no events: the stock format
    "nf4-most-activated": ("nf4", ("adaptive.expert_init='most_activated'",)),
    "nf4-discarded-reused": ("nf4", ("adaptive.period_steps=2",)),
}


@pytest.mark.parametrize("name", EXPORTED)
def test_the_merged_export_has_the_runs_logits(root, name, tmp_path, capsys):
    """Top-any runs after two events (most_activated's second copies an expert the first formed, NF4 re-quantising
    a re-quantised expert) and an NF4 run with its native routing."""
    from transformers import AutoModelForCausalLM

    base_dtype, more = EXPORTED[name]
    _, saved, run, events = losses_to_the_end(root, base_dtype, f"{name}-export", *more, save_at=6)
    assert bool(events) == (name != "nf4-native"), events
    ids = torch.randint(2, 8, (2, 7), generator=torch.Generator().manual_seed(3))
    model = run.parts.model.transformers_model().eval()
    with torch.no_grad(), collect_aux_losses():
        expected = model(input_ids=ids).logits
    main([saved, "--out", str(tmp_path / "merged")])
    assert "model.safetensors" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]
    native = "moe.router='native'" in more
    eager = {"experts_implementation": "eager"} if native else {}  # the stock format: transformers' own experts
    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", trust_remote_code=True, dtype=torch.float64, **eager
    )
    with torch.no_grad(), collect_aux_losses():
        got = merged.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
