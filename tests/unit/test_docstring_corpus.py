"""pretrain-moe's corpus (the installed packages' docstrings) and its BPE tokenizer, on hand-made source trees."""

import json

import pytest

from dynmoe_dist.data.bpe import EOS, padded_vocab, save_tokenizer, train_bpe
from dynmoe_dist.experiments.docstrings import build_corpus, clean, file_docstrings, python_files, read_corpus

MODULE = '''"""The module docstring says what this module is for, in a few words."""

# a comment is no docstring, whatever it says about the module and its functions
NOT_A_DOCSTRING = "a string assigned to a name is no docstring either, however long it gets"


class Widget:
    """A widget holds parts and knows how to assemble them into a whole."""

    def assemble(self):
        """Put the parts together in the order they were added to the widget."""
        note = "a string inside a function body, after the first statement, is not documentation"
        return note


async def fetch():
    """Fetch the parts from the store, waiting for each one as it arrives."""


def short():
    """Too short."""
'''
SHARED = '''def copy_of_assemble():
    """Put the parts together in the order they were added to the widget."""
'''


def write_tree(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "widget.py").write_text(MODULE)
    (root / "pkg" / "copy.py").write_text(SHARED)  # the same docstring again: deduplicated
    (root / "pkg" / "broken.py").write_text("def broken(:\n")  # does not parse: skipped
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "cached.py").write_text('"""A cached file is never read by the corpus walk."""')
    (root / "site-packages").mkdir()  # a base interpreter's packages inside a stdlib root: not ours
    (root / "site-packages" / "other.py").write_text('"""Somebody else\'s package, installed elsewhere entirely."""')
    return root


def test_file_docstrings_are_module_class_and_function_docstrings_only():
    found = file_docstrings(MODULE)
    assert found[0] == "The module docstring says what this module is for, in a few words."
    assert set(found) == {
        "The module docstring says what this module is for, in a few words.",
        "A widget holds parts and knows how to assemble them into a whole.",
        "Put the parts together in the order they were added to the widget.",
        "Fetch the parts from the store, waiting for each one as it arrives.",
        "Too short.",
    }


def test_clean_drops_short_symbolic_and_control_text_and_keeps_paragraphs():
    assert clean("Too short.") is None
    assert clean("+---+---+---+---+---+---+---+---+---+---+---+---+ | | | |") is None  # mostly symbols
    assert clean("A docstring with a \x07 bell in it, long enough to pass the length test.") is None
    text = "First paragraph of a docstring here.   \n\n\n\n    Indented second paragraph, kept."
    assert clean(text) == "First paragraph of a docstring here.\n\n    Indented second paragraph, kept."


def test_build_corpus_is_deduplicated_docstrings_in_a_fixed_order(tmp_path):
    root = write_tree(tmp_path / "lib")
    stats = build_corpus(tmp_path / "a.jsonl", 10_000, [root])
    docs = list(read_corpus(tmp_path / "a.jsonl"))
    assert sorted(docs) == sorted(
        [
            "The module docstring says what this module is for, in a few words.",
            "A widget holds parts and knows how to assemble them into a whole.",
            "Put the parts together in the order they were added to the widget.",
            "Fetch the parts from the store, waiting for each one as it arrives.",
        ]
    )
    assert (stats.num_docs, stats.duplicates, stats.rejected) == (4, 1, 1)  # copy.py's, "Too short."
    assert (stats.files_read, stats.files_skipped, stats.capped) == (2, 1, False)
    assert stats.num_bytes == sum(len(d.encode()) for d in docs)
    again = build_corpus(tmp_path / "b.jsonl", 10_000, [root])
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert again.sha256 == stats.sha256
    # one JSON object per line, the text under "text"
    assert all(set(json.loads(line)) == {"text"} for line in (tmp_path / "a.jsonl").read_text().splitlines())


def test_the_cap_stops_the_corpus_once_it_is_reached(tmp_path):
    root = write_tree(tmp_path / "lib")
    stats = build_corpus(tmp_path / "c.jsonl", 100, [root])
    # documents are 66-68 bytes: the first brings the total to the cap's neighbourhood, the second crosses it
    assert stats.num_docs == 2 and stats.capped
    assert stats.num_bytes - len(list(read_corpus(tmp_path / "c.jsonl"))[-1].encode()) < 100
    with pytest.raises(ValueError, match=r"corpus cap \(0 bytes\) must be >= 1"):
        build_corpus(tmp_path / "d.jsonl", 0, [root])


def test_python_files_skip_caches_and_foreign_site_packages_and_walk_nested_roots_once(tmp_path):
    root = write_tree(tmp_path / "lib")
    (root / "venv").mkdir()
    (root / "venv" / "inner.py").write_text("")
    files = python_files([root, root / "venv"])
    names = sorted(p.name for p in files)
    assert names == ["broken.py", "copy.py", "inner.py", "widget.py"]
    assert files == python_files([root, root / "venv"])  # the same order every time


def test_no_docstring_at_all_is_a_one_line_error(tmp_path):
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no docstring found under"):
        build_corpus(tmp_path / "e.jsonl", 1000, [tmp_path])


def test_tokenizer_round_trips_any_text_and_has_eos(tmp_path):
    from transformers import AutoTokenizer

    texts = [d for d in file_docstrings(MODULE)] * 20
    tokenizer = train_bpe(texts, 320)
    save_tokenizer(tokenizer, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert loaded.eos_token == EOS and loaded.eos_token_id == 0 and len(loaded) <= 320
    # byte level: code, accents, emoji and spacing come back as they were, no unknown token
    for text in ["Put the parts together.", "  def f(x):\n\treturn x ** 2  # ok", "naïve café ☃ \U0001f600"]:
        ids = loaded(text)["input_ids"]
        assert loaded.decode(ids) == text
        assert ids == tokenizer(text)["input_ids"]
    # a learned merge: a frequent word is fewer tokens than its bytes
    assert len(loaded("parts")["input_ids"]) < len("parts")
    with pytest.raises(ValueError, match=r"tokenizer vocabulary \(100\) must be >= 300"):
        train_bpe(texts, 100)


def test_padded_vocab():
    assert (padded_vocab(8192), padded_vocab(8193), padded_vocab(1)) == (8192, 8256, 64)
