"""A LoRA run's checkpoint holds what trains, and names its frozen base (train/checkpoint_base.py).

The tiny imported Qwen3-MoE converted to top-any (8 experts, an adaptive event after step 3 that removes and adds
experts), one process: the checkpoint after step 4 has no frozen base tensor (DCP's keys are adapters and routers,
the expert files adapters only, the discarded expert's frozen weights None), every expert a recipe naming the base
expert its frozen weights come from or the combination an event formed it as (of base or formed experts), and it
is a small fraction of a full finetune's. It resumes with the uninterrupted run's losses (float64, exactly), so
does an upcycled LLaMA's (its experts rebuilt from the dense MLP they copy), a float32 run exported from it gives
the run's logits (1e-6), and a base whose bytes changed is refused at resume and at export in one line naming both
hashes and the path."""

import json
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import (  # noqa: E402
    hf_settings,
    moe_run_settings,
    save_moe_checkpoint,
    save_moe_run_files,
    train_saving,
    write_tiny_run,
)

from dynmoe_dist.moe.adapters import is_adapter  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.train.checkpoint import read_meta  # noqa: E402
from dynmoe_dist.train.checkpoint_base import FROZEN_BASE  # noqa: E402
from dynmoe_dist.train.checkpoint_parts import expert_file, expert_file_owners  # noqa: E402
from dynmoe_dist.train.dense_state import CheckpointError, dense_files, read_metadata  # noqa: E402
from dynmoe_dist.train.tensor_file import read_tensors  # noqa: E402

BASE = "qwen3_moe"
STEPS, SAVE_AT = 6, 4
LORA = ("lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'routed_experts']")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16")


def run(settings, out, save_at=None, resume="", steps=STEPS):
    return train_saving(settings, out, steps, save_at, resume)


def imported(root, *extra, base=BASE):
    return moe_run_settings(root / base, root / "corpus.txt", 1, *TOP_ANY, *extra, steps=STEPS, batch=7)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora_ckpt"), BASE, 8)


@pytest.fixture(scope="module")
def lora_run(root):
    return run(imported(root, *LORA), root / "lora", save_at=SAVE_AT)


def weight_bytes(checkpoint):
    return sum(p.stat().st_size for p in [*dense_files(checkpoint / "dense"), *checkpoint.glob("experts_ep*")])


def test_the_checkpoint_holds_no_frozen_base_tensor(root, lora_run):
    trainer, _, events, checkpoint = lora_run
    assert any(step <= SAVE_AT and added and removed for step, _, removed, added, _ in events), events
    keys = list(read_metadata(checkpoint / "dense").state_dict_metadata)
    names = {key.split("/")[1] for key in keys}
    dense = [n for n, _ in trainer.model.named_parameters() if ".experts.experts." not in n]
    assert names == {n for n in dense if is_adapter(n) or ".router." in n}
    assert any(".router." in n for n in names) and any("q_proj.lora_a" in n for n in names)
    assert all(is_adapter(key.split("/")[1]) for key in keys if key.startswith("adam/"))  # the routers are frozen
    for owner in expert_file_owners(checkpoint):
        flat = read_tensors(expert_file(checkpoint, owner))
        assert flat and all(name.split("/")[3].startswith("lora_") for name in flat), sorted(flat)
    entry = read_meta(checkpoint)["states"]["experts"]
    assert entry[FROZEN_BASE] == "model.path"
    for discarded in entry["discarded"]:
        assert discarded is None or sum(t is not None for t in discarded) == 4  # its two adapters, A and B each
    recipes = [recipe for layer in entry["recipes"] for recipe in layer]
    formed = [combo for layer in entry["formed_recipes"] for combo in layer]
    assert all(len(recipe) == 1 and recipe[0][0].startswith(("base/", "random/", "formed/")) for recipe in recipes)
    assert all(term.startswith(("base/", "random/", "formed/")) for combo in formed for term, _ in combo)
    assert any(recipe[0][0].startswith("formed/") for recipe in recipes) and formed  # the event's added experts


def test_drift_refuses_a_lora_run_in_one_line(root, lora_run):
    from dynmoe_dist.experiments.drift import run_drift

    with pytest.raises(ValueError, match=r"^RUN_DIR \(.*\) is a LoRA run \(lora.enabled\): .* never move$"):
        run_drift(root / "lora")


def test_the_checkpoint_is_a_small_fraction_of_a_full_finetunes(root):
    """At a width where the adapters are what LoRA makes them, a small share of each weight (hidden 128, rank 2)."""
    save_moe_checkpoint(BASE, root / "wide", 8, hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    sizes = {}
    for name, extra in {"lora": LORA, "full": ()}.items():
        settings = imported(root, *extra, "adaptive.enabled=false", base="wide")
        *_, checkpoint = run(settings, root / f"wide-{name}", save_at=2, steps=2)
        sizes[name] = weight_bytes(checkpoint)
    assert sizes["lora"] < 0.1 * sizes["full"], sizes


def test_a_resume_after_experts_were_removed_and_added_is_exact(root, lora_run):
    _, whole, events, checkpoint = lora_run
    _, resumed, later, _ = run(imported(root, *LORA), root / "resumed", resume=str(checkpoint))
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)
    assert later == [e for e in events if e[0] > SAVE_AT]


def test_a_run_without_expert_adapters_resumes_exactly(root):
    """lora.targets without 'routed_experts': the base's experts are frozen whole and an expert an event adds trains
    in full, so its weights are saved; after the resume each expert trains as it did."""
    settings = imported(root, *LORA[:2], "lora.targets=['attention']")
    trainer, whole, events, checkpoint = run(settings, root / "attention", save_at=SAVE_AT)
    assert any(step <= SAVE_AT and added for step, _, _, added, _ in events), events
    saved = {name.split("/")[3] for name in read_tensors(expert_file(checkpoint, 0))}
    assert "w_in" in saved  # an added expert's, trained in full
    resumed_trainer, resumed, _, _ = run(settings, root / "attention-resumed", resume=str(checkpoint))
    assert all(resumed[step] == whole[step] for step in resumed), (resumed, whole)
    trains = [[(n, p.requires_grad) for n, p in t.model.named_parameters()] for t in (trainer, resumed_trainer)]
    assert trains[0] == trains[1]


def test_an_upcycled_run_resumes_exactly(tmp_path):
    """The tiny LLaMA upcycled in blocks 1 and 2 (events after steps 2 and 5): its experts' frozen weights are the
    dense MLPs they copy, rebuilt from model.path."""
    settings = [s for s in hf_settings(*write_tiny_run(tmp_path), steps=6) if not s.startswith("model.freeze")]
    settings += ["lora.enabled=true", "lora.rank=2", "lora.targets=['attention', 'dense_mlp', 'routed_experts']"]
    _, whole, events, checkpoint = run(settings, tmp_path / "whole", save_at=3, steps=6)
    assert any(step <= 3 for step, *_ in events), events
    assert all(name.split("/")[3].startswith("lora_") for name in read_tensors(expert_file(checkpoint, 0)))
    _, resumed, _, _ = run(settings, tmp_path / "resumed", resume=str(checkpoint), steps=6)
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == whole[s] for s in resumed), (resumed, whole)


IDS = torch.randint(2, 8, (2, 7), generator=torch.Generator().manual_seed(3))


def logits(model):
    model.eval()
    with torch.no_grad(), collect_aux_losses():
        return model(input_ids=IDS).logits


def test_a_float32_export_from_it_gives_the_runs_logits(root, tmp_path):
    """Merged into the base read from model.path (remote code: the routers are top-any), experts added by an event
    included."""
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.export import export

    settings = imported(root, *LORA, "train.precision='float32'")
    trainer, _, events, checkpoint = run(settings, tmp_path / "run", save_at=SAVE_AT, steps=SAVE_AT)
    assert any(added for *_, added, _ in events), events
    export(checkpoint, tmp_path / "out", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, dtype=torch.float32)
    expected = logits(trainer.model)  # within 1e-6 of the logits' scale: merging rounds W + (alpha/r) B A once
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("routing", ["native", "top-any"])
def test_the_export_is_the_one_a_checkpoint_with_the_base_gave(root, tmp_path, routing):
    """The same run's state saved as before this change (every weight: weight_parts without a base) and as a LoRA
    checkpoint: the two merged exports are byte for byte the same (top-any: after an event added experts)."""
    from dataclasses import replace

    from dynmoe_dist.export import export
    from dynmoe_dist.train.checkpoint import CheckpointManager
    from dynmoe_dist.train.checkpoint_parts import weight_parts

    extra = ("moe.router='native'", "adaptive.enabled=false") if routing == "native" else ()
    trainer, _, events, checkpoint = run(imported(root, *LORA, *extra), tmp_path / "run", SAVE_AT, steps=SAVE_AT)
    assert routing == "native" or any(added for *_, added, _ in events), events
    config = replace(trainer.config, output=replace(trainer.config.output, out_dir=str(tmp_path / "whole")))
    parts = {**trainer.checkpoint_manager().states, **weight_parts(trainer.parts)}
    whole = CheckpointManager(config, trainer.groups, parts).save(trainer.step)
    assert FROZEN_BASE not in read_meta(whole)["states"]["experts"]
    written = [export(c, tmp_path / f"out{i}", progress=False) for i, c in enumerate((checkpoint, whole))]
    files = [{p.name: p.read_bytes() for p in sorted(out.iterdir())} for out in written]
    assert files[0].keys() == files[1].keys() and all(files[0][n] == files[1][n] for n in files[0]), sorted(files[0])
    with pytest.raises(ValueError, match=r"^--base \(.*\): CHECKPOINT \(.*\) holds every weight, reads no base$"):
        export(whole, tmp_path / "out2", progress=False, base=str(root / BASE))


def test_a_moved_base_exports_with_base(root, lora_run, tmp_path, capsys):
    """``--base`` names where the base is now (its content hash checked): the same files as from model.path."""
    from dynmoe_dist.export import export, main

    checkpoint = lora_run[3]
    shutil.copytree(root / BASE, tmp_path / "moved")
    main([str(checkpoint), "--out", str(tmp_path / "a")])
    main([str(checkpoint), "--out", str(tmp_path / "b"), "--base", str(tmp_path / "moved")])
    capsys.readouterr()
    files = [{p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())} for name in "ab"]
    configs = [json.loads(f.pop("config.json")) for f in files]
    assert files[0] == files[1] and configs[1]["dynmoe"]["base_model"] == str(tmp_path / "moved")
    configs[1]["dynmoe"]["base_model"] = configs[0]["dynmoe"]["base_model"]
    assert configs[0] == configs[1]
    with pytest.raises(ValueError, match=r"^model.path \('.*elsewhere'\) has content no files; .*$"):
        export(checkpoint, tmp_path / "c", progress=False, base=str(tmp_path / "elsewhere"))


def test_a_changed_base_is_refused_at_resume_and_at_export(root, tmp_path):
    from dynmoe_dist.export import export

    shutil.copytree(root / BASE, root / "copied")
    settings = imported(root, *LORA, base="copied")
    *_, checkpoint = run(settings, tmp_path / "run", save_at=1, steps=1)
    weights = next((root / "copied").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="content") as resumed:
        run(settings, tmp_path / "resumed", resume=str(checkpoint), steps=2)
    with pytest.raises(ValueError, match="content") as exported:
        export(checkpoint, tmp_path / "out", progress=False)
    for err in (resumed, exported):
        message = str(err.value)
        hashes = set(re.findall(r"\b[0-9a-f]{32}\b", message))
        assert "\n" not in message and len(hashes) == 2 and str(root / "copied") in message, message
