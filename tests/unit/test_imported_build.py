"""A run on a transformers MoE checkpoint (model.path a save_pretrained directory of any family, or the
vision-language model wrapping one): the config it resolves, the model models/build.py builds on the meta
device, and the weights build_parts reads into it, against transformers' own from_pretrained of the same
directory (float64, transformers' eager experts: exact). Bad checkpoints and options are one line before
any process group.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, corpus_lines, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.models.build import build_model  # noqa: E402
from dynmoe_dist.tasks.base import ModelNeeds  # noqa: E402
from dynmoe_dist.train.parts import build_parts  # noqa: E402

FAMILIES = list(MOE_FAMILIES)


def run_settings(directory, text_file, *extra):
    return [
        "task.name='causal-lm'",
        f"task.path='{text_file}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{directory}'",
        "train.precision='float64'",
        *extra,
    ]


@pytest.fixture(scope="module")
def text_file_here(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("\n".join(corpus_lines()) + "\n")
    return path


def assert_same_logits(ours, theirs, vocab):
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.eval()(ids).logits, theirs.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_run_reads_the_checkpoint_as_transformers_loads_it(family, tmp_path, text_file_here):
    from transformers import AutoConfig

    from dynmoe_dist.models.hf.families import causal_lm_class

    directory, vocab = save_moe_checkpoint(family, tmp_path / family)
    config = load_config(None, run_settings(directory, text_file_here))
    assert config.moe.router == "native"  # the model's own routing unless moe.router says otherwise
    source = build_model(config.model, config.moe, ModelNeeds("causal-lm", vocab, max_len=8))
    assert all(p.is_meta for p in source.model.parameters())  # nothing read before the experts are placed
    parts = build_parts(config, source)
    assert not any(p.is_meta for p in parts.model.parameters())
    cls = causal_lm_class(AutoConfig.from_pretrained(str(directory)))  # Mistral 4: its own class
    theirs = cls.from_pretrained(str(directory), dtype=torch.float64, experts_implementation="eager")
    assert_same_logits(parts.model, theirs, vocab)


def test_a_qwen3_5_vision_language_checkpoint_imports_its_text_model(tmp_path, text_file_here):
    # The hub's Qwen3.5-MoE checkpoints are the vision-language model: config model_type 'qwen3_5_moe' with the
    # text config inside, the text model's keys under model.language_model, a vision tower beside it.
    import transformers
    from hf_tiny import randomize, save_tokenizer, tiny_config

    vocab = save_tokenizer(tmp_path)
    text = tiny_config("qwen3_5_moe_text", vocab).to_dict()
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16, patch_size=2)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision | dict(temporal_patch_size=1))
    torch.manual_seed(0)
    randomize(transformers.Qwen3_5MoeForConditionalGeneration(config)).double().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    run = load_config(None, run_settings(tmp_path, text_file_here))
    assert run.moe.num_experts == 6 and run.model.moe_layers == [0, 1, 2]
    parts = build_parts(run, build_model(run.model, run.moe, ModelNeeds("causal-lm", vocab, max_len=8)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float64, experts_implementation="eager"
    )
    assert type(theirs).__name__ == "Qwen3_5MoeForCausalLM"  # transformers' own load: the text model
    assert_same_logits(parts.model, theirs, vocab)


def test_the_config_takes_the_models_blocks_and_expert_count(tmp_path, text_file_here):
    directory, _ = save_moe_checkpoint("deepseek_v3", tmp_path / "ds")  # first layer dense, 6 experts
    config = load_config(None, run_settings(directory, text_file_here))
    assert config.model.moe_layers == [1, 2] and config.moe.num_experts == 6 and config.model.num_layers == 3
    assert "moe.num_experts" not in config.explicit and "model.moe_layers" not in config.explicit
    converted = load_config(None, run_settings(directory, text_file_here, "moe.router='top_any'"))
    assert converted.moe.router == "top_any" and converted.moe.aux_losses == ("diverse", "simple")  # the preset


def test_options_the_import_decides_are_refused_by_name(tmp_path, text_file_here):
    directory, _ = save_moe_checkpoint("qwen3_moe", tmp_path / "q")
    with pytest.raises(ValueError, match=r"^moe.num_experts \(4\) cannot be set: model.path \('.*'\) is a qwen3_moe"):
        load_config(None, run_settings(directory, text_file_here, "moe.num_experts=4"))
    assert load_config(None, run_settings(directory, text_file_here, "moe.num_experts=6")).moe.num_experts == 6
    with pytest.raises(ValueError, match=r"^moe.calibrate_k \(7\) > the 6 experts: model.path"):
        load_config(None, run_settings(directory, text_file_here, "moe.router='top_any'", "moe.calibrate_k=7"))
    with pytest.raises(
        ValueError, match=r"^model.moe_layers \(\[0\]\) cannot be set: .* \(model.moe_layers = \[1, 2\]\)$"
    ):
        load_config(None, run_settings(directory, text_file_here, "model.moe_layers=[0]"))
    # Qwen3-MoE's router has no correction bias for the balance rule to move (DeepSeek-V3's has: below)
    with pytest.raises(ValueError, match=r"^moe.balance \('bias'\) needs a correction bias .*: model.path"):
        load_config(None, run_settings(directory, text_file_here, "moe.balance='bias'"))
    assert load_config(None, run_settings(directory, text_file_here, "moe.router='top_k'", "moe.balance='bias'"))


def test_deepseek_v3_may_run_its_own_balance_rule(tmp_path, text_file_here):
    directory, _ = save_moe_checkpoint("deepseek_v3", tmp_path / "ds")
    assert load_config(None, run_settings(directory, text_file_here, "moe.balance='bias'")).moe.balance == "bias"


def test_an_unsupported_moe_family_is_named_with_the_supported_ones(tmp_path, text_file_here):
    directory, _ = save_moe_checkpoint("qwen3_moe", tmp_path / "dbrx")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "model_type": "dbrx", "num_experts": 16}))
    with pytest.raises(
        ValueError, match=r"'dbrx' mixture of experts \(num_local_experts = 6\), which is not supported; supported MoE"
    ):
        load_config(None, run_settings(directory, text_file_here))


def test_a_checkpoint_that_disagrees_with_its_config_fails_while_the_model_is_built(tmp_path, text_file_here):
    from safetensors.torch import load_file, save_file

    directory, vocab = save_moe_checkpoint("olmoe", tmp_path / "o")
    config = load_config(None, run_settings(directory, text_file_here))
    state = load_file(str(directory / "model.safetensors"))
    key = "model.layers.1.self_attn.q_proj.weight"
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.safetensors: {key} has shape \(16, 15\), the model's is \(16, 16\)"):
        build_model(config.model, config.moe, ModelNeeds("causal-lm", vocab))


def test_a_printed_config_reads_back(tmp_path, text_file_here):
    """--print-config writes every option, the ones the import filled in included: reading it back works."""
    directory, _ = save_moe_checkpoint("qwen2_moe", tmp_path / "q")
    config = load_config(None, run_settings(directory, text_file_here, "moe.router='top_any'"))
    (tmp_path / "run.toml").write_text(config.to_toml())
    again = load_config(str(tmp_path / "run.toml"))
    assert again.digest() == config.digest()


def test_a_checkpoint_with_tied_embeddings_loads_tied(tmp_path, text_file_here):
    """save_pretrained writes a tied head once (no lm_head.weight); the meta build ties it, so the run reads
    the embedding once and the head is that same parameter (accelerate's empty-weights context would
    untie it if tied inside)."""
    from transformers import AutoModelForCausalLM

    directory, vocab = save_moe_checkpoint("qwen3_moe", tmp_path / "tied", tie_word_embeddings=True)
    config = load_config(None, run_settings(directory, text_file_here))
    parts = build_parts(config, build_model(config.model, config.moe, ModelNeeds("causal-lm", vocab, max_len=8)))
    hf = parts.model.transformers_model()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    theirs = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64, experts_implementation="eager")
    ids = torch.randint(2, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            parts.model.eval()(ids).logits, theirs.eval()(input_ids=ids).logits, rtol=0, atol=1e-10
        )


def test_the_model_source_is_decided_once_per_run(tmp_path, text_file_here, monkeypatch):
    """The config check and the builder both ask what model.path is: config.json is read as an MoE once
    (models.source.moe_at), and the one ImportedCheckpoint the build opens is the one the source carries."""
    from dynmoe_dist.models import source
    from dynmoe_dist.models.hf import families

    directory, vocab = save_moe_checkpoint("qwen3_moe", tmp_path / "once")
    calls = []
    real = families.imported_moe
    monkeypatch.setattr(families, "imported_moe", lambda *args: calls.append(args) or real(*args))
    source._moe_at.cache_clear()
    config = load_config(None, run_settings(directory, text_file_here, "moe.router='top_any'"))
    built = build_model(config.model, config.moe, ModelNeeds("causal-lm", vocab, max_len=8))
    assert len(calls) == 1
    assert isinstance(built, source.ImportedMoE) and built.checkpoint is not None
    assert len(built.routings_to_calibrate()) == len(config.model.moe_layers)  # read through that reader
