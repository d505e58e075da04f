"""The token cache (dynmoe_dist/data): every input format gives the same tokens, the task reads the
windows the in-memory packing cut, a second open reuses the entry and says so, bad data is one line
naming the file and line/row, and a truncated, damaged or other-tokenizer entry is rebuilt."""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import WORDS, corpus_lines, hf_model_settings, save_llama  # noqa: E402
from lm_reference import in_memory_task  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.data import CorpusSpec, open_corpus  # noqa: E402
from dynmoe_dist.data.cache import build_lock  # noqa: E402
from dynmoe_dist.data.fingerprint import DigestMemo  # noqa: E402
from dynmoe_dist.data.prepare import key_inputs, key_of  # noqa: E402
from dynmoe_dist.data.sources import corpus_files  # noqa: E402
from dynmoe_dist.tasks import build_task  # noqa: E402

DOCS = corpus_lines(40, 3)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A word-level tokenizer with the same words in another order: other ids for the same text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("other_tokenizer")
    save_llama(directory, len(WORDS) + 2)  # a model directory: config.json is what marks one
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS[::-1])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return directory


def spec(path, model_dir, cache, **kw):
    return CorpusSpec(str(path), str(model_dir), 8, cache_dir=str(cache), **kw)


def write_formats(directory, docs, column="text"):
    """The same documents as .txt, .jsonl, .parquet and .arrow files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "c.txt").write_text("\n".join(docs) + "\n")
    (directory / "c.jsonl").write_text("\n".join(json.dumps({column: d, "id": i}) for i, d in enumerate(docs)) + "\n")
    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, directory / "c.parquet")
    with pa.OSFile(str(directory / "c.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table)
    return [directory / f"c{s}" for s in (".txt", ".jsonl", ".parquet", ".arrow")]


def test_every_format_gives_the_same_tokens(model_dir, tmp_path):
    from dynmoe_dist.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    want = [t for ids in tok(DOCS, add_special_tokens=False)["input_ids"] for t in ids + [tok.eos_token_id]]
    for file in write_formats(tmp_path / "in", DOCS):
        corpus = open_corpus(spec(file, model_dir, tmp_path / "cache"))
        assert corpus.num_docs == len(DOCS) and corpus.tokens.tolist() == want, file.suffix
    # a directory: its files in sorted path order, subdirectories included
    both = tmp_path / "dir"
    write_formats(both / "b", DOCS[:5])
    write_formats(both / "a", DOCS[5:9])
    write_formats(both / ".ipynb_checkpoints", DOCS[:3])  # hidden: skipped
    files = corpus_files(str(both), "task.path")
    assert [f.relative_to(both).as_posix() for f in files][:2] == ["a/c.arrow", "a/c.jsonl"] and len(files) == 8
    assert open_corpus(spec(both, model_dir, tmp_path / "cache")).num_docs == 4 * 4 + 4 * 5


def test_text_field_names_the_column(model_dir, tmp_path):
    files = write_formats(tmp_path / "in", DOCS[:6], column="body")
    for file in files[1:]:
        corpus = open_corpus(spec(file, model_dir, tmp_path / "cache", text_field="body"))
        assert corpus.num_docs == 6
    with pytest.raises(ValueError, match=r"c.parquet: no column 'text' \(task.text_field\); columns: \['id', 'body'\]"):
        open_corpus(spec(files[2], model_dir, tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"c.jsonl:1: no key 'text' \(task.text_field\); keys: \['body', 'id'\]"):
        open_corpus(spec(files[1], model_dir, tmp_path / "cache"))


def test_task_reads_the_windows_the_in_memory_packing_cut(model_dir, tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines(80, 4)) + "\n")
    config = load_config(None, hf_model_settings(model_dir, tmp_path / "c.txt") + ["task.num_samples=70"])
    task, reference = build_task(config.task), in_memory_task(config.task, corpus_lines(80, 4))
    assert task.num_classes == reference.num_classes
    for split in ("train", "test"):
        assert task.size(split) == reference.size(split) > 0
        indices = torch.randperm(task.size(split), generator=torch.Generator().manual_seed(0))
        got, want = task.batch(split, indices), reference.batch(split, indices)
        assert torch.equal(got.inputs["input_ids"], want.inputs["input_ids"]) and torch.equal(got.targets, want.targets)


def test_second_open_reuses_the_entry_and_says_so(model_dir, tmp_path, capsys):
    file = write_formats(tmp_path / "in", DOCS)[0]
    first = open_corpus(spec(file, model_dir, tmp_path / "cache"))
    assert not first.reused and "tokenised" in capsys.readouterr().err
    built_at = (first.entry / "index.json").stat().st_mtime_ns
    again = open_corpus(spec(file, model_dir, tmp_path / "cache"))
    err = capsys.readouterr().err
    assert again.reused and again.entry == first.entry and (again.entry / "index.json").stat().st_mtime_ns == built_at
    assert f"reusing the token cache of task.path ('{file}'): {first.entry}" in err and "tokenised" not in err
    # other content -> another key -> another entry
    file.write_text("the cat\n" + file.read_text())
    changed = open_corpus(spec(file, model_dir, tmp_path / "cache"))
    assert not changed.reused and changed.entry != first.entry and changed.num_docs == len(DOCS) + 1


def damage_and_reopen(model_dir, tmp_path, capsys, damage, message):
    file = write_formats(tmp_path / "in", DOCS)[0]
    good = open_corpus(spec(file, model_dir, tmp_path / "cache"))
    want = np.array(good.tokens)
    del good
    damage(open_corpus(spec(file, model_dir, tmp_path / "cache")).entry)
    capsys.readouterr()
    rebuilt = open_corpus(spec(file, model_dir, tmp_path / "cache"))
    err = capsys.readouterr().err
    assert not rebuilt.reused and message in err and "rebuilding it" in err, err
    assert np.array_equal(np.array(rebuilt.tokens), want)


def test_truncated_token_file_is_rebuilt(model_dir, tmp_path, capsys):
    def truncate(entry):
        with open(entry / "tokens.bin", "r+b") as f:
            f.truncate(100)

    damage_and_reopen(model_dir, tmp_path, capsys, truncate, "tokens.bin is truncated or damaged (100 bytes")


def test_overwritten_tail_and_unreadable_index_are_rebuilt(model_dir, tmp_path, capsys):
    def overwrite_tail(entry):
        size = (entry / "tokens.bin").stat().st_size
        with open(entry / "tokens.bin", "r+b") as f:
            f.seek(size - 4)
            f.write(b"\xff\xff\xff\xff")

    damage_and_reopen(model_dir, tmp_path, capsys, overwrite_tail, "the end of tokens.bin does not match its checksum")
    damage_and_reopen(
        model_dir, tmp_path, capsys, lambda e: (e / "index.json").write_text("{"), "index.json is unreadable"
    )


def test_entry_of_another_tokenizer_is_rebuilt(model_dir, other_tokenizer, tmp_path, capsys):
    file = write_formats(tmp_path / "in", DOCS)[0]
    cache = tmp_path / "cache"
    mine = open_corpus(spec(file, model_dir, cache))
    # put this tokenizer's entry where the other tokenizer's key points (a copied or renamed cache)
    other = spec(file, other_tokenizer, cache)
    other_entry = cache / key_of(key_inputs(other, corpus_files(other.path, other.field), DigestMemo(cache)))
    shutil.copytree(mine.entry, other_entry)
    capsys.readouterr()
    rebuilt = open_corpus(other)
    err = capsys.readouterr().err
    assert rebuilt.entry == other_entry and not rebuilt.reused
    assert "it was made with another tokenizer" in err and "rebuilding it" in err, err
    fresh = open_corpus(spec(file, other_tokenizer, tmp_path / "fresh"))
    assert rebuilt.tokens.tolist() == fresh.tokens.tolist() != mine.tokens.tolist()


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "nonstring.jsonl",
            '{"text": "a"}\n\n{"text": "b"}\n{"text": 5}\n',
            r"nonstring.jsonl:4: 'text' must be a string, got int \(5\)",
        ),
        ("null.jsonl", '{"text": "a"}\n\n{"text": null}\n', r"null.jsonl:3: 'text' must be a string, got NoneType"),
        ("missing.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"missing.jsonl:2: no key 'text' \(task.text_field\)"),
        ("broken.jsonl", '{"text": "a"}\n{"text": \n', r"broken.jsonl:2: invalid JSON"),
        ("empty.jsonl", "", r"task.path \('.*empty.jsonl'\) holds no text \(1 file\(s\), no documents\)"),
        ("blank.txt", "\n  \n\n", r"task.path \('.*blank.txt'\) holds no text"),
    ],
)
def test_bad_text_files(model_dir, tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        open_corpus(spec(tmp_path / name, model_dir, tmp_path / "cache"))


def test_bad_tables_name_the_row(model_dir, tmp_path):
    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null.parquet: row 2: 'text' must be a string, got null"):
        open_corpus(spec(tmp_path / "null.parquet", model_dir, tmp_path / "cache"))
    pq.write_table(pa.table({"text": [3, 4]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: row 0: 'text' must be a string, got int64 \(3\)"):
        open_corpus(spec(tmp_path / "ints.parquet", model_dir, tmp_path / "cache"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable parquet file"):
        open_corpus(spec(tmp_path / "junk.parquet", model_dir, tmp_path / "cache"))


def test_bad_paths(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"task.path \('.*nothing'\) does not exist"):
        open_corpus(spec(tmp_path / "nothing", model_dir, tmp_path / "cache"))
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"task.path \('.*notes.csv'\) must be a .txt / .jsonl / .parquet / .arrow"):
        open_corpus(spec(tmp_path / "notes.csv", model_dir, tmp_path / "cache"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"is a directory without .txt / .jsonl / .parquet / .arrow files"):
        open_corpus(spec(tmp_path / "empty_dir", model_dir, tmp_path / "cache"))


def test_waiting_for_another_build_times_out_with_a_clear_error(tmp_path):
    with build_lock(tmp_path / "k.lock"):
        with pytest.raises(TimeoutError, match=r"waited 0 s for another process building the token cache"):
            with build_lock(tmp_path / "k.lock", timeout_s=0.3):
                pass


def test_a_failed_or_finished_build_leaves_no_lock_file(model_dir, tmp_path):
    (tmp_path / "missing.jsonl").write_text('{"body": "b"}\n')
    with pytest.raises(ValueError, match="no key 'text'"):
        open_corpus(spec(tmp_path / "missing.jsonl", model_dir, tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("\n".join(DOCS) + "\n")
    open_corpus(spec(tmp_path / "c.txt", model_dir, tmp_path / "cache"))
    assert list((tmp_path / "cache").rglob("*.lock")) == []


def test_a_lock_on_a_file_removed_meanwhile_is_not_taken(tmp_path, monkeypatch):
    """A start opens the lock file, the holder finishes (removing it) before the start's flock: that flock
    succeeds on a file no later start can see; the start must lock the file now at the path instead, so
    that a third start has to wait for it."""
    import builtins
    import fcntl

    from dynmoe_dist.data import cache

    lock, opened = tmp_path / "k.lock", []

    def open_then_lose_the_file(path, mode):
        file = builtins.open(path, mode)
        if not opened:
            Path(path).unlink()  # the previous holder finished between this open and the flock
        opened.append(file)
        return file

    monkeypatch.setattr(cache, "open", open_then_lose_the_file, raising=False)
    with build_lock(lock):
        assert len(opened) == 2  # the lost file, then the one at the path
        with builtins.open(lock, "w") as third, pytest.raises(BlockingIOError):
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock.exists()


def test_a_short_wait_is_quiet_and_a_long_one_is_announced(tmp_path, capsys, monkeypatch):
    """The ranks of one job wait for each other's build, often for a second or two (or for a build that
    fails at once): no 'waiting' line before that error. A long wait says what it waits for."""
    monkeypatch.delenv("RANK", raising=False)
    for quiet_s, announced in ((10.0, False), (0.1, True)):
        with build_lock(tmp_path / "k.lock"):
            with pytest.raises(TimeoutError):
                with build_lock(tmp_path / "k.lock", timeout_s=0.5, quiet_s=quiet_s):
                    pass
        assert ("waiting for another process" in capsys.readouterr().err) == announced


def test_prepare_command_then_training_reuses(model_dir, tmp_path, capsys):
    import subprocess
    import sys

    from dynmoe_dist.data.__main__ import main

    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in corpus_lines(60)) + "\n")
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        "[task]\nname = 'causal-lm'\n"
        f"path = '{tmp_path / 'c.jsonl'}'\nmax_len = 8\ncache_dir = '{tmp_path / 'cache'}'\n"
        f"[model]\nsource = 'hf'\npath = '{model_dir}'\nnum_layers = 3\nmoe_layers = [1]\n"
    )
    cmd = [sys.executable, "-m", "dynmoe_dist.data", "prepare", "--config", str(run_file)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert not result["reused"] and result["num_docs"] == 60 and result["tokens_per_s"] > 0
    capsys.readouterr()
    assert main(["prepare", "--config", str(run_file)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["reused"] and second["entry"] == result["entry"]
    task = build_task(load_config(str(run_file)).task)  # the run maps the prepared entry
    assert str(task.windows["train"].tokens.filename) == os.path.join(result["entry"], "tokens.bin")
    capsys.readouterr()
    assert main(["prepare", "--path", str(tmp_path / "none.txt"), "--tokenizer", str(model_dir)]) == 2
    assert (
        capsys.readouterr().err.strip() == "python -m dynmoe_dist.data: error: --max-len is required without --config"
    )


def test_worker_processes_keep_the_document_order(model_dir, tmp_path):
    from dynmoe_dist.data.prepare import MIN_DOCS_PER_WORKER

    docs = corpus_lines(2 * MIN_DOCS_PER_WORKER, 6)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    one = open_corpus(spec(tmp_path / "c.jsonl", model_dir, tmp_path / "one", num_proc=1))
    two = open_corpus(spec(tmp_path / "c.jsonl", model_dir, tmp_path / "two", num_proc=2))  # 2 map workers
    assert two.num_docs == len(docs) and np.array_equal(np.array(one.tokens), np.array(two.tokens))
    assert np.array_equal(np.array(one.doc_offsets), np.array(two.doc_offsets))


def test_a_dead_builders_leftovers_are_removed(model_dir, tmp_path):
    file = write_formats(tmp_path / "in", DOCS)[0]
    s = spec(file, model_dir, tmp_path / "cache")
    key = key_of(key_inputs(s, corpus_files(s.path, s.field), DigestMemo(tmp_path / "cache")))
    stale = tmp_path / "cache" / f".build-{key}-999999"
    (stale / "hf").mkdir(parents=True)
    (stale / "tokens.bin").write_bytes(b"\0" * 64)
    corpus = open_corpus(s)
    assert not stale.exists() and corpus.entry.name == key and corpus.num_docs == len(DOCS)
    assert sorted(p.name for p in corpus.entry.iterdir()) == ["docs.npy", "index.json", "tokens.bin"]


def test_test_path_is_the_held_out_corpus(model_dir, tmp_path):
    from lm_reference import pack

    from dynmoe_dist.data.tokenizers import load_tokenizer

    train_docs, test_docs = corpus_lines(50, 7), corpus_lines(20, 8)
    (tmp_path / "train.txt").write_text("\n".join(train_docs) + "\n")
    pq.write_table(pa.table({"text": test_docs}), tmp_path / "held_out.parquet")
    settings = hf_model_settings(model_dir, tmp_path / "train.txt") + [
        f"task.test_path='{tmp_path / 'held_out.parquet'}'"
    ]
    task = build_task(load_config(None, settings).task)
    tok = load_tokenizer(str(model_dir))
    for split, docs in (("train", train_docs), ("test", test_docs)):  # every document, in file order
        want = pack(docs, tok, 8)
        got = task.batch(split, torch.arange(task.size(split)))
        assert torch.equal(got.inputs["input_ids"], want["input_ids"]) and torch.equal(got.targets, want["targets"])
