"""'causal-lm' reading its windows from the memory-mapped token cache trains exactly like the in-memory
packing it replaced: float64 per-step losses and the held-out loss on 1, 2 and 3 ranks equal the
single-process in-memory reference (1 rank: bit for bit; 2 and 3: to 1e-9, the summation order), with
uneven shares (7 sequences per step over 2 and 3 ranks) and across an epoch boundary. A checkpoint
written mid-epoch resumes to the uninterrupted run's losses, on its own world size and on another one
(2 ranks -> 3). All ranks of a world open its missing token cache at once: exactly one builds it.

Each world's group is spawned once for the module; the 3-rank cluster resumes the 2-rank checkpoint."""

import functools
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hf_tiny import WORDS, corpus_lines, hf_model_settings, save_llama, save_tokenizer  # noqa: E402

from dynmoe_dist.parallel.simulate import run_simulated  # noqa: E402

STEPS, SAVE_AT = 14, 6  # 11 steps per epoch (below): the run crosses into epoch 1, the save is mid-epoch 0


def write_corpus(path):
    """Short and long documents (a window spans several, a long document several windows), as JSON lines."""
    long_docs = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(30 + 5 * i)) for i in range(4)]
    docs = corpus_lines(90, 5)[:40] + long_docs + corpus_lines(90, 5)[40:]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    return docs


def settings(model_dir, corpus, out_dir):
    return [
        *hf_model_settings(model_dir, corpus),
        "task.max_len=8",
        "train.precision='float64'",
        f"train.max_steps={STEPS}",
        "train.global_batch_size=7",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "adaptive.enabled=false",
        f"output.out_dir='{out_dir}'",
        f"task.cache_dir='{out_dir}/token_cache'",  # every world builds its own: its ranks race for the lock
    ]


def train(config, steps, start_from=""):
    """Losses of steps [start, steps); a checkpoint at SAVE_AT when starting fresh; the final test loss."""
    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(config)
    manager = trainer.checkpoint_manager()
    if start_from:
        manager.resume(start_from)
    losses, saved = {}, None
    while trainer.step < steps:
        step = trainer.step
        losses[step] = trainer.train_step()["loss"]
        if trainer.step == SAVE_AT and not start_from:
            saved = str(manager.save(trainer.step))
    return dict(
        losses=losses,
        test_loss=trainer.evaluate()["test_loss"],
        saved=saved,
        steps_per_epoch=trainer.schedule.steps_per_epoch,
    )


def lm_worker(model_dir, corpus, out_dir, resume_from=""):
    from dynmoe_dist.config import load_config
    from dynmoe_dist.data import open_corpus
    from dynmoe_dist.tasks.causal_lm import corpus_spec

    config = load_config(None, settings(model_dir, corpus, out_dir))
    # all ranks open the missing entry at once: one builds it under the lock, the others wait and reuse it
    built = not open_corpus(corpus_spec(config.task, config.task.path, "task.path")).reused
    result = train(config, STEPS)
    result["built_the_cache"] = built
    result["resumed"] = train(config, STEPS, start_from=resume_from or result["saved"])["losses"]
    return result


def in_memory_reference(model_dir, corpus, out_dir, docs):
    """One process, the windows packed in memory (tests/lm_reference.py) instead of read from the cache."""
    from lm_reference import in_memory_task

    import dynmoe_dist.train.loop as loop
    from dynmoe_dist.config import load_config

    built = loop.build_task
    loop.build_task = lambda task_config: in_memory_task(task_config, docs)
    try:
        return train(load_config(None, settings(model_dir, corpus, out_dir)), STEPS)
    finally:
        loop.build_task = built


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_stream")
    model_dir = root / "model"
    save_llama(model_dir, save_tokenizer(model_dir))
    docs = write_corpus(root / "corpus.jsonl")
    return str(model_dir), str(root / "corpus.jsonl"), str(root), tuple(docs)


@functools.lru_cache(maxsize=None)
def _cluster(world, model_dir, corpus, root, resume_from=""):
    args = (model_dir, corpus, f"{root}/w{world}", resume_from)
    if world == 1:
        return [lm_worker(*args)]
    return run_simulated(lm_worker, world, args=args, timeout_s=400)


@pytest.fixture(scope="module")
def reference(files):
    model_dir, corpus, root, docs = files
    return in_memory_reference(model_dir, corpus, f"{root}/in_memory", list(docs))


def world_results(files, world):
    model_dir, corpus, root, _ = files
    if world == 3:  # resumes the 2-rank checkpoint: another world size, mid-epoch
        return _cluster(3, model_dir, corpus, root, _cluster(2, model_dir, corpus, root)[0]["saved"])
    return _cluster(world, model_dir, corpus, root)


def test_the_run_crosses_an_epoch_and_saves_mid_epoch(reference):
    assert reference["steps_per_epoch"] == 11 and SAVE_AT % 11 != 0 and STEPS > 11


def test_one_rank_reads_exactly_the_in_memory_windows(files, reference):
    got = world_results(files, 1)[0]
    assert got["losses"] == reference["losses"] and got["test_loss"] == reference["test_loss"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_rank_builds_the_token_cache(files, world):
    assert sum(r["built_the_cache"] for r in world_results(files, world)) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_same_losses_on_two_and_three_ranks(files, reference, world):
    for rank, got in enumerate(world_results(files, world)):
        assert sorted(got["losses"]) == list(range(STEPS))
        for step, want in reference["losses"].items():
            assert abs(got["losses"][step] - want) <= 1e-9 * abs(want), f"world {world} rank {rank} step {step}"
        assert abs(got["test_loss"] - reference["test_loss"]) <= 1e-9 * reference["test_loss"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_mid_epoch_continues_the_uninterrupted_run(files, reference, world):
    """World 1 and 2 resume their own checkpoint; world 3 resumes the 2-rank one."""
    for rank, got in enumerate(world_results(files, world)):
        assert sorted(got["resumed"]) == list(range(SAVE_AT, STEPS))
        for step, loss in got["resumed"].items():
            want = reference["losses"][step]
            assert abs(loss - want) <= 1e-9 * abs(want), f"world {world} rank {rank} step {step}"
