"""A full finetune's checkpoint exports with nothing else on disk, and names the base it was trained from.

Two tiny runs, one process: the LLaMA upcycled with model.freeze (its frozen embeddings and block 0 are in
the checkpoint like every other weight) and an imported OLMoE with its own routing (stock export). Each is
exported, its base at model.path moved away, and ``python -m dynmoe_dist.export`` run again: every file of
the two exports is byte-for-byte the same. The checkpoint's model/ carries the base's config and the
tokenizer with a content hash the export checks; meta.pt names the base by path and content hash, and a
resume from a base whose content changed fails in one line naming both hashes and the path.
"""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hf_tiny import corpus_lines, moe_run_settings, save_moe_checkpoint, write_tiny_run  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.export import main  # noqa: E402
from dynmoe_dist.train.checkpoint import read_checkpoint_dense, read_meta  # noqa: E402


def settings(model_dir, text_file, out_dir, *extra):
    """A 3-step float64 run on one process (hf_tiny's imported-MoE run settings, an event after step 2)."""
    return moe_run_settings(model_dir, text_file, 1, f"output.out_dir='{out_dir}'", *extra, steps=3)


GENERATION = {"do_sample": True, "temperature": 0.42, "top_p": 0.9, "bos_token_id": 0, "eos_token_id": 1}
UPCYCLED = ("model.moe_layers=[1, 2]", "moe.num_experts=3", "model.freeze=['model.embed_tokens', 'model.layers.0']")


def train(config_settings):
    from dynmoe_dist.train.checkpoint import last_complete_checkpoint
    from dynmoe_dist.train.run import run

    config = load_config(None, config_settings)
    run(config)
    return last_complete_checkpoint(config.output.out_dir)


def export_files(checkpoint, out, capsys):
    main([str(checkpoint), "--out", str(out)])
    capsys.readouterr()
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory):
    root = tmp_path_factory.mktemp("upcycled")
    model_dir, text_file = write_tiny_run(root)
    # the base's own generation settings, which the export must carry (not transformers' defaults)
    (Path(model_dir) / "generation_config.json").write_text(json.dumps(GENERATION))
    # task.tokenizer unset: the tokenizer too is the base's, at model.path
    return root, model_dir, train(settings(model_dir, text_file, root / "run", *UPCYCLED))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    model_dir, _ = save_moe_checkpoint("olmoe", root / "olmoe")
    (root / "c.txt").write_text("\n".join(corpus_lines()) + "\n")
    return root, str(model_dir), train(settings(model_dir, root / "c.txt", root / "run"))


@pytest.mark.parametrize("case", ["upcycled", "imported"])
def test_the_export_needs_nothing_but_the_checkpoint(case, request, tmp_path, capsys):
    root, model_dir, checkpoint = request.getfixturevalue(case)
    before = export_files(checkpoint, tmp_path / "before", capsys)
    moved = root / "moved"
    shutil.move(model_dir, moved)
    try:
        after = export_files(checkpoint, tmp_path / "after", capsys)
    finally:
        shutil.move(moved, model_dir)
    assert sorted(after) == sorted(before) and "model.safetensors" in after and "tokenizer.json" in after
    assert [name for name in before if before[name] != after[name]] == []
    if case == "upcycled":
        generation = json.loads(after["generation_config.json"])
        assert {k: generation.get(k) for k in GENERATION} == GENERATION


def test_a_checkpoint_from_before_model_dir_exports_from_model_path(upcycled, tmp_path, capsys):
    """An older checkpoint (no model/ part) builds its model from model.path, to the same files."""
    import torch

    _, _, checkpoint = upcycled
    old = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, old)
    shutil.rmtree(old / "model")
    meta = read_meta(old)
    del meta["states"]["model"]
    torch.save(meta, old / "meta.pt")
    got = export_files(old, tmp_path / "old", capsys)
    assert got == export_files(checkpoint, tmp_path / "new", capsys)


def test_frozen_weights_are_saved_and_the_base_is_named_by_its_content(upcycled):
    _, model_dir, checkpoint = upcycled
    assert "hf.model.embed_tokens.weight" in read_checkpoint_dense(checkpoint)  # frozen, saved all the same
    entry = read_meta(checkpoint)["states"]["model"]
    assert entry["base"]["path"] == model_dir and len(entry["base"]["digest"]) == 32
    assert (checkpoint / "model" / "config.json").read_bytes() == (Path(model_dir) / "config.json").read_bytes()


def test_a_resume_from_a_changed_base_names_both_hashes(imported):
    from safetensors.torch import load_file, save_file

    from dynmoe_dist.train.dense_state import CheckpointError
    from dynmoe_dist.train.run import run

    root, model_dir, checkpoint = imported
    weights = os.path.join(model_dir, "model.safetensors")
    original = open(weights, "rb").read()
    state = load_file(weights)
    key = "model.layers.0.self_attn.q_proj.weight"
    state[key] = state[key] + 1
    save_file(state, weights, metadata={"format": "pt"})
    saved = read_meta(checkpoint)["states"]["model"]["base"]["digest"]
    try:
        config = load_config(
            None,
            settings(model_dir, root / "c.txt", root / "run", f"output.resume='{checkpoint}'", "train.max_steps=4"),
        )
        with pytest.raises(CheckpointError) as caught:
            run(config)
    finally:
        open(weights, "wb").write(original)
    message = str(caught.value)
    assert "\n" not in message and saved in message and repr(model_dir) in message
    assert message.startswith(f"checkpoint {checkpoint} was trained from a base with content {saved}")


def test_a_moved_base_resumes_by_its_content(imported, tmp_path):
    """model.path may change between the run and its resume: the content hash, not the path, says it is the
    base the checkpoint was trained from."""
    from dynmoe_dist.train.run import start

    root, model_dir, checkpoint = imported
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_dir, moved)
    resumed = settings(moved, root / "c.txt", tmp_path / "run", f"output.resume='{checkpoint}'", "train.max_steps=4")
    assert start(load_config(None, resumed)).trainer.step == 3  # resumed at the checkpoint's step


def test_the_export_checks_the_saved_definition(upcycled, tmp_path, capsys):
    _, _, checkpoint = upcycled
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    config = copy / "model" / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    with pytest.raises(SystemExit):
        main([str(copy), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert err.startswith(f"error: {copy / 'model'}: the model definition has content ") and err.count("\n") == 1
