"""`python -m dynmoe_dist.experiments lm-eval` on a tiny export (format 2, LLaMA base, word-level tokenizer):
the task files hold snippets the SmolLM2 demo never trains on; the perplexities lm-eval reports equal the
ones computed here from the exported model's logits on the same documents (the held-out perplexity task
wiring: rolling log-likelihood of the text, after the EOS prefix token), and the multiple-choice accuracy
equals the one computed here from the two labels' log-likelihoods, over --limit documents.

lm_eval imports in about 10 s and scores in a few more: slow."""

import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

from hf_remote_cases import export_case  # noqa: E402

from dynmoe_dist.experiments import lmeval  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 6


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    export_case(root / "model", "llama", torch.float32, "top1")
    lmeval.main(
        [str(root / "model"), "--limit", str(LIMIT), "--num-docs", "20", "--tasks-dir", str(root / "tasks")]
        + ["--train-config", str(ROOT / lmeval.DEFAULT_TRAIN_CONFIG), "--out", str(root / "out.json")]
    )
    docs = [json.loads(line) for line in (root / "tasks" / lmeval.DATA_FILE).read_text().splitlines()]
    return root, json.loads((root / "out.json").read_text()), docs


def exported(root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(root / "model")
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory, trust_remote_code=True)


def loglikelihood(model, context, continuation):
    """Sum of log p(continuation tokens | context tokens before them)."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return float(sum(logp[p, t] for p, t in zip(positions, continuation)))


def test_the_documents_were_never_trained_on(evaluated):
    from dynmoe_dist.tasks.common import subset_indices
    from dynmoe_dist.tasks.text import load_rotten_tomatoes

    _, report, docs = evaluated
    texts, labels = load_rotten_tomatoes()
    num_samples, seed = lmeval.trained_subset(str(ROOT / lmeval.DEFAULT_TRAIN_CONFIG))
    assert (num_samples, seed) == (3000, 1234)
    trained = {texts[i] for i in subset_indices(len(texts), num_samples, seed).tolist()}
    assert len(docs) == report["held_out_snippets"] == 20
    assert not {d["text"] for d in docs} & trained
    assert all(labels[texts.index(d["text"])] == d["label"] for d in docs)
    assert {d["label"] for d in docs} == {0, 1}


def test_perplexity_is_the_models_own(evaluated):
    root, report, docs = evaluated
    model, tokenizer = exported(root)
    total_ll, words, num_bytes = 0.0, 0, 0
    for doc in docs[:LIMIT]:
        ids = tokenizer.encode(doc["text"])
        assert 0 < len(ids) < model.config.max_position_embeddings  # one window: no rolling over a context
        total_ll += loglikelihood(model, [tokenizer.eos_token_id], ids)
        words += len(re.split(r"\s+", doc["text"]))
        num_bytes += len(doc["text"].encode("utf-8"))
    got = report["tasks"][lmeval.PERPLEXITY_TASK]
    assert report["num_docs"][lmeval.PERPLEXITY_TASK] == LIMIT
    assert got["word_perplexity"] == pytest.approx(math.exp(-total_ll / words), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(-total_ll / num_bytes), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(-total_ll / num_bytes / math.log(2), rel=1e-5)


def test_sentiment_accuracy_over_the_limit(evaluated):
    root, report, docs = evaluated
    model, tokenizer = exported(root)
    correct = 0
    for doc in docs[:LIMIT]:
        context = tokenizer.encode(f"Review: {doc['text']}\nSentiment:")
        scores = [loglikelihood(model, context, tokenizer.encode(f" {label}")) for label in lmeval.LABELS]
        correct += int(max(range(2), key=lambda i: (scores[i], -i)) == doc["label"])  # ties: the first choice
    got = report["tasks"][lmeval.SENTIMENT_TASK]
    assert report["num_docs"][lmeval.SENTIMENT_TASK] == LIMIT
    assert 0.0 <= got["acc"] <= 1.0 and got["acc"] == pytest.approx(correct / LIMIT)


def test_bad_input_is_one_line_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lmeval.main([str(tmp_path), "--train-config", ""])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"DIR ('{tmp_path}') has no config.json" in err
    with pytest.raises(SystemExit):
        lmeval.main([str(tmp_path), "--limit", "0"])
    assert "--limit (0) must be >= 1" in capsys.readouterr().err


def test_a_tokenizer_without_bos_or_eos_starts_documents_with_cls(tmp_path):
    """The BERT WordPiece tokenizer next to a user's model has no BOS and no EOS: lm-eval gets [CLS] as
    the token its rolling log-likelihood starts from; a tokenizer that has an EOS keeps lm-eval's choice."""
    import shutil

    from hf_tiny import save_tokenizer

    from dynmoe_dist.tasks.assets import minilm_dir

    bert, word_level = tmp_path / "bert", tmp_path / "word_level"
    bert.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, bert / name)
    save_tokenizer(word_level)  # has <eos>
    assert lmeval.start_token(bert, str(bert)) == 101  # [CLS] of the uncased BERT vocabulary
    assert lmeval.start_token(word_level, str(word_level)) is None


@pytest.fixture(scope="module")
def file_scored(evaluated):
    """lm-eval --file on a .jsonl of the user's (its documents under 'body'), over the same export."""
    from hf_tiny import corpus_lines

    root = evaluated[0]
    docs = corpus_lines(5, 7)
    (root / "mine.jsonl").write_text("".join(json.dumps({"body": text, "id": i}) + "\n" for i, text in enumerate(docs)))
    lmeval.main(
        [str(root / "model"), "--file", str(root / "mine.jsonl"), "--text-field", "body"]
        + ["--tasks-dir", str(root / "file_tasks"), "--out", str(root / "file.json")]
    )
    return root, json.loads((root / "file.json").read_text()), docs


def test_the_users_file_gets_the_models_own_perplexity(file_scored):
    root, report, docs = file_scored
    model, tokenizer = exported(root)
    total_ll, words, num_bytes = 0.0, 0, 0
    for text in docs:
        total_ll += loglikelihood(model, [tokenizer.eos_token_id], tokenizer.encode(text))
        words += len(re.split(r"\s+", text))
        num_bytes += len(text.encode("utf-8"))
    assert set(report["tasks"]) == {lmeval.FILE_TASK} and "held_out_snippets" not in report  # only the file
    assert report["num_docs"][lmeval.FILE_TASK] == len(docs)
    got = report["tasks"][lmeval.FILE_TASK]
    assert got["word_perplexity"] == pytest.approx(math.exp(-total_ll / words), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(-total_ll / num_bytes), rel=1e-5)


def test_tasks_are_checked_against_lm_evals_own_before_the_model_loads(evaluated, capsys):
    model = str(evaluated[0] / "model")
    for tasks, expected in (
        ("hellaswg", "--tasks: 'hellaswg' is not an lm-eval task installed here (close names: hellaswag"),
        ("lambada_openai", "--tasks: 'lambada_openai' reads its data from the Hugging Face hub"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            lmeval.main([model, "--tasks", tasks, "--train-config", ""])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and expected in err, err
