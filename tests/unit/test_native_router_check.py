"""moe.router = 'native' (an imported MoE's own routing) on a model that has none is one line at the config
check, in the user's terms (the option, the file, what it is, what to use instead), before any weight is
read: a dense GGUF is not dequantised first."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hf_tiny import save_moe_checkpoint, save_tiny_with_tokenizer  # noqa: E402

from dynmoe_dist.train.cli import main  # noqa: E402

pytest.importorskip("gguf")


def write_gguf_header(path, architecture, expert_count=None):
    """A GGUF file with a header only (no tensors): all the check may read."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    if expert_count is not None:
        writer.add_expert_count(expert_count)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(capsys, monkeypatch, model_path, source="hf"):
    """The error line of a native-router run on model_path; loading any weights fails the test."""
    from dynmoe_dist.models.hf import loading

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the error")

    monkeypatch.setattr(loading, "load_model", no_weights)
    capsys.readouterr()  # what writing the model printed
    settings = ["task.name='causal-lm'", "task.path='rotten-tomatoes'", "moe.router='native'"]
    settings += [f"model.source='{source}'"] + ([f"model.path='{model_path}'"] if model_path else [])
    assert main([arg for setting in settings for arg in ("--set", setting)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynmoe-train: error: moe.router ('native') keeps the routing")
    assert "NativeRule" not in err
    return err


def test_a_dense_gguf_is_refused_from_its_header(tmp_path, capsys, monkeypatch):
    path = write_gguf_header(tmp_path / "dense.gguf", "llama")
    err = refused(capsys, monkeypatch, path)
    assert f"model.path ('{path}') is a dense llama model (its GGUF header has no llama.expert_count)" in err
    assert "leave moe.router unset" in err and "'top_k' or 'top_p'" in err


def test_a_gguf_mixture_of_experts_is_pointed_to_its_transformers_directory(tmp_path, capsys, monkeypatch):
    path = write_gguf_header(tmp_path / "moe.gguf", "llama", expert_count=8)
    err = refused(capsys, monkeypatch, path)
    assert f"model.path ('{path}') is a GGUF llama with 8 experts per layer" in err
    assert "imported from a transformers directory" in err


def test_a_dense_directory_and_the_builtin_model_are_refused(tmp_path, capsys, monkeypatch):
    directory = save_tiny_with_tokenizer("llama", tmp_path / "llama")
    assert f"model.path ('{directory}') is a dense llama model: leave moe.router unset" in refused(
        capsys, monkeypatch, directory
    )
    err = refused(capsys, monkeypatch, "", source="builtin")
    assert "model.source ('builtin') builds this project's own model" in err


def test_an_imported_moe_keeps_its_routing(tmp_path, capsys):
    directory, _ = save_moe_checkpoint("olmoe", tmp_path / "olmoe")
    settings = ["task.name='causal-lm'", "task.path='rotten-tomatoes'", "moe.router='native'"]
    settings += ["model.source='hf'", f"model.path='{directory}'"]
    assert main([arg for setting in settings for arg in ("--set", setting)] + ["--print-config"]) == 0
    assert 'router = "native"' in capsys.readouterr().out
