# Ray must keep 127.0.0.1 (not the machine's outward address): set before anything imports ray.
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Two cores: keep every test process single-threaded unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Token caches of the causal-lm tests (dynmoe_dist/data) go to a fresh directory, not ~/.cache; the
# subprocesses the tests start inherit it.
if "DYNMOE_TOKEN_CACHE" not in os.environ:
    import tempfile

    os.environ["DYNMOE_TOKEN_CACHE"] = tempfile.mkdtemp(prefix="dynmoe-token-cache-")

import torch  # noqa: E402

torch.set_num_threads(1)


# -- the tiny Hugging Face model directory the HF tests share (tests/hf_tiny.py builds it) --------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny LLaMA saved with save_pretrained next to a word-level tokenizer (the vocabularies match)."""
    from hf_tiny import save_tiny_with_tokenizer

    return save_tiny_with_tokenizer("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """60 lines of the tokenizer's words, one document per line."""
    from hf_tiny import corpus_lines

    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(corpus_lines()) + "\n")
    return path
