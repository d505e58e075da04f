"""'causal-lm' task and loading from a local path: a tiny LLaMA + word-level tokenizer saved offline.

The model directory is what save_pretrained writes (config.json + model.safetensors) plus the tokenizer
files; nothing is downloaded (HF_HUB_OFFLINE=1)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import WORDS, corpus_lines, hf_model_settings, save_llama, save_tiny  # noqa: E402  (tests/hf_tiny.py)

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.tasks import build_task  # noqa: E402
from dynmoe_dist.tasks.causal_lm import CausalLMTask  # noqa: E402


def model_of(config, task=None):
    """The run's model as the trainer builds it: models/build.py from [model] + [moe] and the task's needs."""
    from dynmoe_dist.models.build import build_model

    task = task if task is not None else build_task(config.task)
    return build_model(config.model, config.moe, task.model_needs()).model


def config_for(model_dir, text_file, *extra):
    return load_config(
        None,
        [
            *hf_model_settings(model_dir, text_file),
            "moe.num_experts=3",
            "train.global_batch_size=6",
            "train.max_steps=3",
            "adaptive.enabled=false",
            *extra,
        ],
    )


def test_windows_hand_worked(model_dir, tmp_path):
    from dynmoe_dist.data import CorpusSpec, open_corpus
    from dynmoe_dist.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("the", "cat", "dog", "<eos>")}
    (tmp_path / "three.txt").write_text("the cat\ndog\n\nthe\n")
    corpus = open_corpus(CorpusSpec(str(tmp_path / "three.txt"), str(model_dir), 2))
    # stream: the cat <eos> dog <eos> the <eos> -> L=2 windows of 3: [the cat <eos>] [dog <eos> the]
    assert corpus.num_docs == 3 and corpus.tokens.tolist() == [
        ids[w] for w in "the cat <eos> dog <eos> the <eos>".split()
    ]
    windows = corpus.windows(torch.arange(3).numpy(), 2)
    assert len(windows) == 2
    assert windows.read([1, 0]).tolist() == [
        [ids["dog"], ids["<eos>"], ids["the"]],
        [ids["the"], ids["cat"], ids["<eos>"]],
    ]
    # documents in another order (a shuffled split): 'dog' 'the' 'the cat' -> [dog <eos> the] [<eos> the cat]
    other = corpus.windows([1, 2, 0], 2)
    assert other.read([1]).tolist() == [[ids["<eos>"], ids["the"], ids["cat"]]]
    with pytest.raises(IndexError, match=r"window index out of range \[0, 2\)"):
        windows.read([2])


def test_too_little_text_for_one_window(model_dir, tmp_path):
    (tmp_path / "short.txt").write_text("the\ncat\n")
    with pytest.raises(ValueError, match=r"task.path \(train split\): 2 tokens make no sequence of task.max_len \+ 1"):
        build_task(config_for(model_dir, tmp_path / "short.txt").task)


def test_task_splits_held_out_documents(model_dir, text_file):
    task = build_task(config_for(model_dir, text_file).task)
    assert isinstance(task, CausalLMTask) and task.num_classes == len(WORDS) + 2
    assert task.splits == {}  # nothing in memory: windows are read from the token file per batch
    for split in ("train", "test"):
        s = task.batch(split, torch.arange(task.size(split)))
        assert s.inputs["input_ids"].shape == s.targets.shape and s.targets.shape[1] == 8
        # targets are the inputs shifted by one token
        assert torch.equal(s.inputs["input_ids"][:, 1:], s.targets[:, :-1])
    assert task.size("test") >= 1 and task.size("train") > task.size("test")
    assert task.count_items("train", torch.arange(5)) == 5 * 8


def test_jsonl_and_directory_input(model_dir, tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in corpus_lines(30, 1)))
    (tmp_path / "b.txt").write_text("\n".join(corpus_lines(30, 2)))
    cfg = config_for(model_dir, tmp_path).task
    task = build_task(cfg)
    one = build_task(config_for(model_dir, tmp_path / "a.jsonl").task)
    assert task.size("train") + task.size("test") > one.size("train") + one.size("test")
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no key 'text' \(task.text_field\); keys: \['txt'\]"):
        build_task(config_for(model_dir, tmp_path / "bad.jsonl").task)


def test_loss_sums_are_world_size_invariant(model_dir, text_file):
    config = config_for(model_dir, text_file)
    task = build_task(config.task)
    torch.manual_seed(0)
    model = model_of(config, task).eval()
    indices = torch.arange(6)
    batch = task.batch("train", indices)
    with torch.no_grad():
        out = model(**batch.inputs)
    assert out.logits.shape == (6, 8, task.num_classes) and out.aux_loss.dim() == 0
    full, correct = task.loss_terms(out.logits, batch.targets)
    # the trainer's split over 2 and 3 ranks: summed loss and the global item count do not change
    for world in (2, 3):
        parts = [task.loss_terms(out.logits[c], batch.targets[c]) for c in torch.arange(6).chunk(world)]
        torch.testing.assert_close(sum(p[0] for p in parts), full, rtol=1e-6, atol=0)
        torch.testing.assert_close(sum(p[1] for p in parts), correct)
    assert task.count_items("train", indices) == batch.targets.numel()
    # per-token mean against torch's own mean cross-entropy
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, task.num_classes), batch.targets.reshape(-1))
    torch.testing.assert_close(full / task.count_items("train", indices), want)
    # 'correct' / sequences is the token accuracy
    acc = (out.logits.argmax(-1) == batch.targets).double().mean()
    torch.testing.assert_close(correct.double() / len(indices), acc)


def test_build_model_upcycles_freezes_and_trains(model_dir, text_file):
    from dynmoe_dist.moe.layer import find_moe_layers
    from dynmoe_dist.train.loop import Trainer

    config = config_for(model_dir, text_file, "model.freeze=['model.embed_tokens', 'model.layers.0']")
    trainer = Trainer(config)
    assert len(find_moe_layers(trainer.model)) == 2
    frozen = [n for n, p in trainer.model.named_parameters() if not p.requires_grad]
    assert "hf.model.embed_tokens.weight" in frozen and any(n.startswith("hf.model.layers.0.") for n in frozen)
    assert not any(n.startswith("hf.model.layers.1.") for n in frozen)
    before = trainer.evaluate()
    records = [trainer.train_step() for _ in range(3)]
    assert all(r["task_loss"] > 0 and r["mean_k"][0] >= 1 for r in records)
    assert 0 <= before["test_accuracy"] <= 1 and before["test_loss"] > 0


# -- bad input: ValueError naming the thing, raised while the model is built (before any process group)
def test_missing_directory(tmp_path, text_file, model_dir):
    config = config_for(model_dir, text_file)
    config.model.path = str(tmp_path / "nope")
    task = build_task(config.task)
    with pytest.raises(ValueError, match=r"model.path \('.*nope'\) does not exist"):
        model_of(config, task)


def test_directory_without_config_json(tmp_path, text_file, model_dir):
    config = config_for(model_dir, text_file)
    config.model.path = str(tmp_path)
    with pytest.raises(ValueError, match=r"model.path \('.*'\) has no config.json"):
        model_of(config)


def test_gguf_that_does_not_parse(tmp_path, text_file, model_dir):
    pytest.importorskip("gguf")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    config = config_for(model_dir, text_file)
    config.model.path = str(bad)
    with pytest.raises(ValueError, match=r"model.path \('.*model.gguf'\) is not a readable GGUF file"):
        model_of(config)


def test_architecture_without_known_mlp(tmp_path, text_file, model_dir):

    save_tiny("gpt_neox", tmp_path, 16, num_hidden_layers=1)
    config = config_for(model_dir, text_file, "model.moe_layers=[0]")
    config.model.path = str(tmp_path)
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM: no dense MLP of a known architecture.*supported"):
        model_of(config)


def test_num_layers_comes_from_the_model(model_dir, text_file):
    assert config_for(model_dir, text_file).model.num_layers == 3  # hf_model_settings does not set it
    assert config_for(model_dir, text_file, "model.num_layers=3").model.num_layers == 3


def test_num_layers_that_disagrees_with_the_model_names_both(model_dir, text_file):
    with pytest.raises(ValueError, match=r"model.num_layers \(5\) != the 3 blocks of the model at model.path"):
        config_for(model_dir, text_file, "model.num_layers=5", "model.moe_layers=[4]")


def test_moe_layer_beyond_the_model(model_dir, text_file):
    with pytest.raises(ValueError, match=r"model.moe_layers entry \(3\) outside \[0, num_layers \(3\)\)"):
        config_for(model_dir, text_file, "model.moe_layers=[3]")


def test_the_built_model_is_checked_against_num_layers_too(model_dir, text_file):
    config = config_for(model_dir, text_file)
    config.model.num_layers = 4  # set after the loader checked it
    with pytest.raises(ValueError, match=r"model.num_layers \(4\) != the 3 blocks of LlamaForCausalLM"):
        model_of(config)


def test_missing_tokenizer(tmp_path, text_file):
    save_llama(tmp_path, 16)  # config.json + weights, no tokenizer files
    with pytest.raises(ValueError, match=r"task.tokenizer \('.*'\) holds no tokenizer"):
        build_task(config_for(tmp_path, text_file).task)


def test_config_requires_path_for_hf():
    with pytest.raises(ValueError, match=r"model.path \(''\) must name"):
        load_config(None, ["model.source='hf'"])
    with pytest.raises(ValueError, match=r"model.source \('hub'\) must be one of"):
        load_config(None, ["model.source='hub'"])


def test_trainer_fails_before_any_process_group(tmp_path, text_file, model_dir):
    import torch.distributed as dist

    from dynmoe_dist.train.loop import Trainer

    config = config_for(model_dir, text_file)
    config.model.path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"model.path \('.*missing'\) does not exist"):
        Trainer(config)
    assert not dist.is_initialized()


def test_smollm2_run_config_trains_only_the_top_two_blocks():
    config = load_config("launcher/configs/smollm2_dynmoe.toml")
    assert (config.task.name, config.model.source, config.model.num_layers) == ("causal-lm", "hf", 30)
    assert config.model.moe_layers == [28, 29] and config.moe.num_experts == 4
    # freeze prefixes stop at dots: 'model.layers.2' does not freeze block 28
    assert sorted(config.model.freeze) == sorted(["model.embed_tokens"] + [f"model.layers.{i}" for i in range(28)])
    assert config.parallel.ep_size == 2 and config.task.tokenizer == config.model.path


def test_load_config_checks_what_it_can_without_loading(model_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match=r"model.path \('.*nowhere'\) does not exist"):
        config_for(model_dir, text_file, f"model.path='{tmp_path / 'nowhere'}'")
    with pytest.raises(ValueError, match=r"task 'causal-lm' needs model.source = 'hf' \(got 'builtin'\)"):
        config_for(model_dir, text_file, "model.source='builtin'", "model.num_layers=3")  # builtin default: 2
    # no task.tokenizer: the model's own
    assert config_for(model_dir, text_file, "task.tokenizer=''").task.tokenizer == str(model_dir)


def test_options_the_run_ignores_are_named():
    from dynmoe_dist.train.startup import ignored_options

    builtin = load_config(None, ["model.path='x'"])  # task 'synthetic' builds its model from [model]
    assert {m.split(" ")[0] for m in ignored_options(builtin)} == {"model.path"}
    # a source that cannot build the task's model is an error, not a warning
    with pytest.raises(ValueError, match=r"model.source \('hf'\) cannot build a token-classifier model; use one of"):
        load_config(None, ["model.source='hf'", "model.path='x'"])
