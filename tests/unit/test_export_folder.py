"""`python -m dynmoe_dist.export`'s folder and files: a used folder is refused in one line unless --overwrite,
which empties an earlier export (and nothing that is not one); above --max-shard-size the weights go into
shards with an index, as save_pretrained writes them, and both loaders read them back: plain transformers
the stock export of a run with the model's own routing, dynmoe_dist.hf.from_pretrained (and transformers
with trust_remote_code) the remote-code export of a top-any run. Equal to the single-file export, float64."""

import inspect
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import corpus_lines, moe_run_settings, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.export import main  # noqa: E402
from dynmoe_dist.models.hf.export_files import MAX_SHARD_SIZE, refusal_to_empty, shard_size_bytes  # noqa: E402

INDEX = "model.safetensors.index.json"
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=12", "moe.combine='softmax'")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{'stock': checkpoint of a native-routing run, 'top_any': of a converted run} of a tiny Qwen3-MoE, and
    the vocabulary size."""
    from dynmoe_dist.train.checkpoint import complete_checkpoints
    from dynmoe_dist.train.run import run

    root = tmp_path_factory.mktemp("export_folder")
    _, vocab = save_moe_checkpoint("qwen3_moe", root / "model")
    (root / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    found = {}
    for name, extra in (("stock", ()), ("top_any", TOP_ANY)):
        out_dir = root / name
        settings = moe_run_settings(root / "model", root / "corpus.txt", 1, f"output.out_dir='{out_dir}'", *extra)
        run(load_config(None, [s.replace("train.max_steps=6", "train.max_steps=2") for s in settings]))
        found[name] = complete_checkpoints(str(out_dir))[-1]
    return found, vocab


def export(capsys, *args):
    """main(args) -> (exit status, stdout, stderr lines)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def logits(model, vocab):
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_the_default_shard_size_is_save_pretrained_s():
    from transformers import PreTrainedModel

    assert inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default == MAX_SHARD_SIZE


def shards_of(folder: Path):
    index = json.loads((folder / INDEX).read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards
    assert not (folder / "model.safetensors").exists()
    return shards


def test_small_shards_of_a_stock_export_load_in_plain_transformers(checkpoints, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    found, vocab = checkpoints
    assert export(capsys, found["stock"], "--out", tmp_path / "one")[0] == 0
    code, out, _ = export(capsys, found["stock"], "--out", tmp_path / "shards", "--max-shard-size", "20KB")
    assert code == 0
    shards = shards_of(tmp_path / "shards")
    assert set(shards) | {INDEX} <= set(json.loads(out)["files"])
    assert not list((tmp_path / "shards").glob("*.py"))  # a stock export has no remote code

    def load(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")

    assert torch.equal(logits(load(tmp_path / "shards"), vocab), logits(load(tmp_path / "one"), vocab))


def test_small_shards_of_a_top_any_export_load_in_both_loaders(checkpoints, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from dynmoe_dist.hf import from_pretrained

    found, vocab = checkpoints
    assert export(capsys, found["top_any"], "--out", tmp_path / "one")[0] == 0
    assert export(capsys, found["top_any"], "--out", tmp_path / "shards", "--max-shard-size", "20KB")[0] == 0
    shards_of(tmp_path / "shards")
    want = logits(from_pretrained(tmp_path / "one"), vocab)
    assert torch.equal(logits(from_pretrained(tmp_path / "shards"), vocab), want)
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "shards", trust_remote_code=True, dtype=torch.float64)
    torch.testing.assert_close(logits(remote, vocab), want, rtol=1e-9, atol=1e-9)


def test_a_used_folder_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    found, _ = checkpoints
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    code, _, err = export(capsys, found["stock"], "--out", used)
    assert code == 2 and len(err) == 1 and f"--out ('{used}') is not empty (notes.txt)" in err[0], err
    assert "--overwrite" in err[0] and (used / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export_and_lists_only_what_it_wrote(checkpoints, tmp_path, capsys):
    found, _ = checkpoints
    out = tmp_path / "export"
    assert export(capsys, found["top_any"], "--out", out, "--max-shard-size", "20KB")[0] == 0
    assert list(out.glob("*.py")) and (out / INDEX).exists()
    code, printed, _ = export(capsys, found["stock"], "--out", out, "--overwrite")
    assert code == 0
    files = sorted(p.name for p in out.iterdir())
    assert json.loads(printed)["files"] == files
    assert not [f for f in files if f.endswith(".py") or f.startswith("model-") or f == INDEX], files
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_overwrite_empties_nothing_that_is_not_an_earlier_export(checkpoints, tmp_path, capsys):
    found, _ = checkpoints
    checkpoint = found["stock"]
    run_dir = checkpoint.parents[1]
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "config.json").write_text("{}")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.bin").write_text("x")
    for folder, why in (
        (checkpoint, "it holds the checkpoint"),
        (run_dir, "it holds the checkpoint"),
        (checkpoint / "dense", "it is inside the checkpoint"),
        (other, "it holds folders (sub)"),
        (plain, "it holds no config.json"),
    ):
        before = sorted(p.name for p in folder.iterdir())
        code, _, err = export(capsys, checkpoint, "--out", folder, "--overwrite")
        assert code == 2 and len(err) == 1 and why in err[0], err
        assert sorted(p.name for p in folder.iterdir()) == before
    # The root and the home directory: the check alone (no export is tried there).
    assert refusal_to_empty(Path("/"), checkpoint).startswith("it holds the checkpoint")
    if not (checkpoint.resolve().is_relative_to(Path.home()) or Path.cwd().is_relative_to(Path.home())):
        assert refusal_to_empty(Path.home(), checkpoint) == "it holds the home directory"


def test_a_bad_shard_size_is_one_line(checkpoints, tmp_path, capsys):
    found, _ = checkpoints
    code, _, err = export(capsys, found["stock"], "--out", tmp_path / "x", "--max-shard-size", "lots")
    assert code == 2 and len(err) == 1 and "--max-shard-size ('lots')" in err[0], err
    assert not (tmp_path / "x").exists()
    assert shard_size_bytes("20000") == shard_size_bytes("20KB") == 20000


def test_help_says_remote_code_only_for_a_converted_run(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "unless the run kept the model's own routing, moe.router = 'native', the remote code" in text
    assert "--overwrite" in text and "--max-shard-size" in text


def test_a_broken_export_is_one_line_naming_the_file(checkpoints, tmp_path, capsys):
    from dynmoe_dist.hf import from_pretrained

    found, _ = checkpoints
    out = tmp_path / "shards"
    assert export(capsys, found["top_any"], "--out", out, "--max-shard-size", "20KB")[0] == 0
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"{shard}: not a readable safetensors file"):
        from_pretrained(out)
    (out / "config.json").write_text("{")
    with pytest.raises(ValueError, match=f"from_pretrained: {out / 'config.json'} is not a readable JSON file"):
        from_pretrained(out)
