"""Task 'chat' trains the same on any number of ranks: float64 per-step losses, the held-out loss and the
accuracy on 2 and 3 ranks equal the single-process run's (1e-9, the summation order), with uneven shares (7
packed sequences per step over 2 and 3 ranks) and across an epoch boundary; a mid-epoch checkpoint of the
2-rank run resumes on 3 ranks to the uninterrupted losses. Every rank reads only its own sequences from the
memmap (the reads are counted), and exactly one rank of a world builds the token cache. (The resume is
slow-marked: the schedule it restores is causal-lm's, whose resume tests/distributed/test_token_stream.py
checks in the default suite.)

Each world's group is spawned once for the module."""

import functools
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hf_tiny import WORDS, randomize, save_chat_tokenizer, tiny_model  # noqa: E402

from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS, SAVE_AT, BATCH = 9, 4, 7


def write_conversations(path, n=60):
    rng = np.random.default_rng(3)
    records = []
    for i in range(n):
        turns = [{"role": "user", "content": " ".join(rng.choice(WORDS, size=rng.integers(1, 7)))}]
        turns.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, size=rng.integers(1, 5)))})
        pair = {"prompt": turns[0]["content"], "completion": turns[1]["content"]}
        records.append({"messages": turns} if i % 3 else pair)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def settings(model_dir, corpus, out_dir):
    return [
        "task.name='chat'",
        f"task.path='{corpus}'",
        "task.max_len=24",
        f"task.cache_dir='{out_dir}/token_cache'",  # every world builds its own: its ranks race for the lock
        "model.source='hf'",
        f"model.path='{model_dir}'",
        "moe.router='top_any'",
        "train.precision='float64'",
        f"train.max_steps={STEPS}",
        f"train.global_batch_size={BATCH}",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "adaptive.enabled=false",
        f"output.out_dir='{out_dir}'",
    ]


def train(config, start_from=""):
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(config)
    manager = trainer.checkpoint_manager()
    if start_from:
        manager.resume(start_from)
    read = trainer.task.packed["train"]
    seen = []
    original = read.read
    read.read = lambda indices: seen.extend(np.asarray(indices).tolist()) or original(indices)
    losses, accuracy, saved = {}, {}, None
    while trainer.step < STEPS:
        step = trainer.step
        record = trainer.train_step()
        losses[step], accuracy[step] = record["loss"], record["accuracy"]
        if trainer.step == SAVE_AT and not start_from:
            saved = str(manager.save(trainer.step))
    evaluated = trainer.evaluate()
    return dict(
        losses=losses,
        accuracy=accuracy,
        test_loss=evaluated["test_loss"],
        saved=saved,
        steps_per_epoch=trainer.schedule.steps_per_epoch,
        sequences=len(read),
        seen=seen,
    )


def chat_worker(model_dir, corpus, out_dir, resume_from=""):
    from dynmoe_dist.config import load_config
    from dynmoe_dist.data import open_corpus
    from dynmoe_dist.tasks.chat import corpus_spec

    config = load_config(None, settings(model_dir, corpus, out_dir))
    built = not open_corpus(corpus_spec(config.task, config.task.path, "task.path")).reused
    result = train(config, start_from=resume_from)
    result["built_the_cache"] = built
    return result


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_stream")
    vocab = save_chat_tokenizer(root / "model")
    randomize(tiny_model("qwen3_moe", vocab)).double().save_pretrained(root / "model")
    write_conversations(root / "chat.jsonl")
    return str(root / "model"), str(root / "chat.jsonl"), str(root)


@functools.lru_cache(maxsize=None)
def _cluster(world, model_dir, corpus, root, resume_from=""):
    args = (model_dir, corpus, f"{root}/w{world}{'_resumed' if resume_from else ''}", resume_from)
    if world == 1:
        return [chat_worker(*args)]
    return run_simulated(chat_worker, world, args=args, timeout_s=400)


def results(files, world, resume_from=""):
    return _cluster(world, *files, resume_from)


def test_the_run_crosses_an_epoch_with_uneven_shares(files):
    one = results(files, 1)[0]
    assert one["steps_per_epoch"] < STEPS and one["sequences"] % BATCH != 0
    assert SAVE_AT % one["steps_per_epoch"] != 0


@pytest.mark.parametrize("world", [2, 3])
def test_same_losses_accuracy_and_held_out_loss_on_two_and_three_ranks(files, world):
    want = results(files, 1)[0]
    for rank, got in enumerate(results(files, world)):
        for step, loss in want["losses"].items():
            assert abs(got["losses"][step] - loss) <= 1e-9 * abs(loss), f"world {world} rank {rank} step {step}"
            assert abs(got["accuracy"][step] - want["accuracy"][step]) <= 1e-9
        assert abs(got["test_loss"] - want["test_loss"]) <= 1e-9 * want["test_loss"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_reads_only_its_share(files, world):
    got = results(files, world)
    reads = [sorted(r["seen"]) for r in got]
    assert sum(len(r) for r in reads) == len(results(files, 1)[0]["seen"])  # no sequence read twice
    if world > 1:
        assert all(len(r) < len(results(files, 1)[0]["seen"]) for r in reads)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_rank_builds_the_token_cache(files, world):
    assert sum(r["built_the_cache"] for r in results(files, world)) == 1


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_three_ranks(files):
    want = results(files, 1)[0]["losses"]
    for rank, got in enumerate(results(files, 3, resume_from=results(files, 2)[0]["saved"])):
        assert sorted(got["losses"]) == list(range(SAVE_AT, STEPS))
        for step, loss in got["losses"].items():
            assert abs(loss - want[step]) <= 1e-9 * abs(want[step]), f"rank {rank} step {step}"
