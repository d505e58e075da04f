"""Models a user builds: a tiny LLaMA and a tiny Qwen2 made with transformers and written with
save_pretrained, the BERT WordPiece tokenizer files of all-MiniLM-L6-v2 copied next to them (no EOS
token), trained as 'causal-lm' with adaptive events on 2 and 3 ranks: the same per-step losses, expert
counts, events and held-out loss as one process.

The held-out split is 7 sequences and a global batch is 6, so the evaluation's last batch of 1 sample
used to leave ranks with an empty batch: the attention of the transformers model cannot reshape 0
elements and `torchrun --nproc-per-node 2` died with a ChildFailedError. The Qwen2 case also checks the
tokenizer: transformers 5 loads a Qwen2 directory's tokenizer as Qwen2Tokenizer whatever its files hold
(a character-level BPE with an added token), models/hf/loading.py keeps the WordPiece the files hold.

Each world's group is spawned once for the module (one run_simulated call trains both models)."""

import functools
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import ADAPTIVE, WORDS, save_tiny, train_recorded  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

# About 90 s on 2 shared cores (the 30522-token vocabulary, 3 worlds); the pure parts (evaluation ranges,
# the tokenizer of a Qwen2 directory) have fast tests in tests/unit.
pytestmark = pytest.mark.slow

KINDS = ("llama", "qwen2")
BATCH = 6
MAX_LEN = 8
STEPS = 6  # events after steps 2 and 5 (adaptive.period_steps = 3)
NUM_TEST = 7  # held-out sequences: 7 = 6 + 1, the last evaluation batch has one sample for 2 or 3 ranks
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def save_user_model(kind, directory):
    """What a user does: a transformers model with the tokenizer's vocabulary size, save_pretrained, and
    the tokenizer files copied next to it."""
    from dynmoe_dist.tasks.assets import minilm_dir

    source = minilm_dir()
    vocab_size = sum(1 for _ in open(source / "vocab.txt", encoding="utf-8"))
    save_tiny(kind, directory, vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)


def write_text(path, num_lines, words_per_line, seed):
    """Lines of words that are one WordPiece token each (hf_tiny.WORDS): the token count is known."""
    g = torch.Generator().manual_seed(seed)
    lines = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (words_per_line,), generator=g))]
    lines += [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (words_per_line,), generator=g))
        for _ in range(num_lines - 1)
    ]
    path.write_text("\n".join(lines) + "\n")


def settings(model_dir, train_file, test_file, world):
    return [
        "task.name='causal-lm'",
        f"task.path='{train_file}'",
        f"task.test_path='{test_file}'",
        f"task.tokenizer='{model_dir}'",
        f"task.max_len={MAX_LEN}",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        "model.moe_layers=[1, 2]",
        "model.freeze=['model.embed_tokens', 'model.layers.0']",
        *ADAPTIVE,
        "train.precision='float64'",
        f"train.max_steps={STEPS}",
        f"train.global_batch_size={BATCH}",
        "train.lr=0.01",
        "train.warmup_steps=1",
        f"parallel.ep_size={world}",
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
        "output.final_checkpoint=false",
    ]


def train_one(model_dir, train_file, test_file, world):
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(load_config(None, settings(model_dir, train_file, test_file, world)))
    _, losses, counts, events = train_recorded(trainer, STEPS)
    tokenizer = trainer.task.tokenizer_path
    return dict(
        losses=losses,
        counts=counts,
        events=events,
        test_loss=trainer.evaluate()["test_loss"],
        num_test=trainer.task.size("test"),
        vocab=trainer.task.num_classes,
        tokenizer=tokenizer,
    )


def worker(root, world):
    return {kind: train_one(f"{root}/{kind}", f"{root}/train.txt", f"{root}/test.txt", world) for kind in KINDS}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_models")
    for kind in KINDS:
        save_user_model(kind, root / kind)
    write_text(root / "train.txt", 40, 9, seed=1)  # 360 tokens: 40 sequences of 9
    # 9 lines of 7 one-token words, no EOS between them: 63 tokens = 7 sequences of 8 inputs + 1
    write_text(root / "test.txt", 9, 7, seed=2)
    return str(root)


@functools.lru_cache(maxsize=None)
def _cluster(world, root):
    if world == 1:
        return [worker(root, 1)]
    return run_simulated(worker, world, args=(root, world), timeout_s=300)


@pytest.fixture(scope="module")
def reference(root):
    return _cluster(1, root)[0]


@pytest.fixture(scope="module", params=[2, 3])
def world(request, root):
    return request.param, _cluster(request.param, root)


def test_the_tokenizer_has_no_eos_and_the_split_leaves_one_sample(root, reference):
    from dynmoe_dist.data.tokenizers import load_tokenizer

    for kind in KINDS:
        tokenizer = load_tokenizer(f"{root}/{kind}")
        assert tokenizer.eos_token_id is None, kind
        assert len(tokenizer) == reference[kind]["vocab"] == 30522, kind  # no token added (Qwen2Tokenizer adds one)
        assert tokenizer("the cat sat", add_special_tokens=False)["input_ids"] == [1996, 4937, 2938], kind
        run = reference[kind]
        assert run["num_test"] == NUM_TEST and NUM_TEST % BATCH == 1, "the case needs a last batch of one sample"


def test_reference_removes_and_adds_experts(reference):
    for kind in KINDS:
        events = reference[kind]["events"]
        assert any(e[2] for e in events) and any(e[3] for e in events), (kind, events)


def test_two_and_three_ranks_train_and_evaluate_like_one_process(world, reference):
    size, results = world
    for rank, got_all in enumerate(results):
        for kind in KINDS:
            got, ref = got_all[kind], reference[kind]
            where = f"{kind} world {size} rank {rank}"
            assert got["counts"] == ref["counts"], where
            assert got["events"] == ref["events"], where
            for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert abs(a - b) <= 1e-9 * abs(b), f"{where} step {step}: {a} vs {b}"
            assert abs(got["test_loss"] - ref["test_loss"]) <= 1e-9 * ref["test_loss"], where
