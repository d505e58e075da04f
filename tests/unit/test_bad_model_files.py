"""A broken input model (model.path) is one line naming the file and what is wrong, at the config check that
runs before any rank starts: a truncated shard, a shard whose header is not safetensors, a shard the index
names but the directory lacks, a config.json that is not JSON. In-process through `cli.main` (the config
check every rank and the launcher run), once under launcher/torchrun.sh, and in the reading path itself
(CheckpointReader), which a rank reaches only when the files changed after the check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_tiny import corpus_lines, save_moe_checkpoint

from dynmoe_dist.models.hf.loading import resolve
from dynmoe_dist.models.hf.safetensors_reader import CheckpointReader, check_weight_files
from dynmoe_dist.train.cli import main

ROOT = Path(__file__).resolve().parents[2]


def second_shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Qwen3-MoE saved in several shards with an index, as save_pretrained writes a large one."""
    import transformers

    root = tmp_path_factory.mktemp("sharded")
    directory, _ = save_moe_checkpoint("qwen3_moe", root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    for path in directory.glob("*.safetensors"):
        path.unlink()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=size // 3 + 1)
    assert len(list(directory.glob("model-*.safetensors"))) >= 3
    return directory


@pytest.fixture
def model_copy(sharded, tmp_path):
    """A copy of the sharded model the test may break."""
    copy = tmp_path / "model"
    copy.mkdir()
    (tmp_path / "corpus.txt").write_text("\n".join(corpus_lines()) + "\n")
    for path in sharded.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def truncate(directory: Path) -> str:
    shard = second_shard(directory)
    shard.write_bytes(shard.read_bytes()[:-100])
    return f"{shard}: not a readable safetensors file"


def garbage_header(directory: Path) -> str:
    shard = second_shard(directory)
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + b"not json at all" + data[23:])
    return f"{shard}: not a readable safetensors file"


def missing_shard(directory: Path) -> str:
    shard = second_shard(directory)
    shard.unlink()
    return f"names shard '{shard.name}'"


def shard_without_key(directory: Path) -> str:
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = second_shard(directory).name
    key = next(key for key, name in index["weight_map"].items() if name != shard)
    index["weight_map"][key] = shard
    index_file.write_text(json.dumps(index))
    return f"names '{shard}' for {key}, which that shard does not hold"


def bad_config_json(directory: Path) -> str:
    (directory / "config.json").write_text('{"model_type": "qwen3_moe",')
    return f"{directory / 'config.json'} is not a readable JSON file"


BREAKS = [truncate, garbage_header, missing_shard, shard_without_key, bad_config_json]


def run_args(model_dir: Path, out_dir: Path):
    settings = [
        "task.name='causal-lm'",
        f"task.path='{model_dir.parent / 'corpus.txt'}'",  # the test's corpus, beside the model copy
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        "train.max_steps=1",
        "output.progress=false",
        "output.report=false",
        f"output.out_dir='{out_dir}'",
    ]
    return [arg for setting in settings for arg in ("--set", setting)]


@pytest.mark.parametrize("damage", BREAKS, ids=lambda f: f.__name__)
def test_a_broken_model_file_is_one_line_naming_it_at_the_config_check(model_copy, tmp_path, capsys, damage):
    expected = damage(model_copy)
    assert main([*run_args(model_copy, tmp_path / "out"), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dynmoe-train: error: model.path ('{model_copy}')"), err
    assert expected in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_intact_model_passes_the_check(sharded):
    directory, gguf = resolve(str(sharded))
    assert (directory, gguf) == (sharded, None)
    check_weight_files(sharded)


@pytest.mark.parametrize("damage", [truncate, garbage_header], ids=lambda f: f.__name__)
def test_the_reader_names_a_file_that_broke_after_the_check(model_copy, damage):
    """A rank reads the files after the check; a file that changed in between still gives the file's name."""
    expected = damage(model_copy)
    with CheckpointReader(model_copy) as reader:
        key = next(key for key in reader.keys() if reader.files[key] == second_shard(model_copy))
        with pytest.raises(ValueError, match="not a readable safetensors file") as err:
            reader.tensor(key)
    assert expected in str(err.value)


def test_a_truncated_shard_under_torchrun_is_one_line_before_any_rank_starts(model_copy, tmp_path):
    expected = truncate(model_copy)
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    cmd = ["sh", "launcher/torchrun.sh", "2", *run_args(model_copy, tmp_path / "out")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynmoe-train: error: ") and expected in lines[0], lines
