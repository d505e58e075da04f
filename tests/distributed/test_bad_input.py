"""Bad input fails clearly on every rank before any data collective; a silent rank becomes an error
that names the collective instead of a hang."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynmoe_dist.config import load_config
from dynmoe_dist.parallel.simulate import run_simulated

BASE = [
    "task.num_samples=200",
    "task.max_len=8",
    "model.dim=16",
    "model.num_heads=2",
    "model.ffn_dim=16",
    "train.max_steps=2",
    "train.global_batch_size=8",
    "adaptive.enabled=false",
]

CASES = {
    "ep_size": (["parallel.ep_size=3"], r"parallel.ep_size \(3\) does not divide the world size \(4\)"),
    "experts": (["moe.num_experts=3", "moe.min_experts=1"], r"num_experts \(3\) < ep_size \(4\)"),
    "batch": (["train.global_batch_size=6", "train.grad_accum=2"], r"micro-batch size \(3 .*\) < world size \(4\)"),
    "mismatch": (None, r"config hash differs across ranks"),
}


def _trainer_error(overrides):
    from dynmoe_dist.train.loop import Trainer

    try:
        Trainer(load_config(None, BASE + overrides))
    except ValueError as err:
        return str(err)
    return None


def bad_input_worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    errors = {}
    for name, (overrides, _) in CASES.items():
        if overrides is None:  # every rank but rank 1 uses the default learning rate
            overrides = ["train.lr=0.5"] if rank == 1 else []
        errors[name] = _trainer_error(overrides)
    dist.barrier()  # the group still works after every one of these errors
    return errors


def silent_rank_worker():
    """Rank 1 stalls; rank 0's first training collective must fail with a named, timed-out error."""
    import torch.distributed as dist

    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(load_config(None, BASE + ["parallel.timeout_s=3"]))
    if dist.get_rank() == 1:
        time.sleep(8)
        return None
    started = time.monotonic()
    try:
        trainer.train_step()
    except Exception as err:  # noqa: BLE001 - the point is what it says
        return type(err).__name__, str(err), time.monotonic() - started
    return None


def test_bad_input_errors_on_every_rank():
    results = run_simulated(bad_input_worker, 4, timeout_s=120)
    for name, (_, pattern) in CASES.items():
        for rank, errors in enumerate(results):
            assert errors[name] is not None, f"{name}: rank {rank} raised nothing"
            assert re.search(pattern, errors[name]), f"{name}: rank {rank}: {errors[name]}"


def test_silent_rank_gives_named_timeout():
    results = run_simulated(silent_rank_worker, 2, timeout_s=120, collective_timeout_s=3)
    kind, message, seconds = results[0]
    assert kind == "CollectiveError"
    assert "collective '" in message and "rank 0" in message and "timeout 3s" in message
    assert seconds < 30, message


# ----------------------------------------------------------------------------------------------------
# The same mistakes as a user makes them: `launcher/torchrun.sh 2 ...`, the whole output read


ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--set=output.progress=false", "--set=output.report=false", "--set=output.tensorboard=false"]
TINY_RUN = [f"--set={setting}" for setting in BASE] + QUIET


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """A tiny LLaMA with its tokenizer, a JSON-lines corpus whose text sits under 'body' (not 'text'), and a
    checkpoint directory whose meta.pt is not a torch file."""
    from hf_tiny import corpus_lines, save_llama, save_tokenizer

    root = tmp_path_factory.mktemp("user_files")
    save_llama(root / "model", save_tokenizer(root / "model"))
    (root / "body.jsonl").write_text("".join(json.dumps({"body": line}) + "\n" for line in corpus_lines()))
    (root / "corrupt_ckpt").mkdir()
    (root / "corrupt_ckpt" / "meta.pt").write_bytes(b"not a torch file")
    return root


def _causal_lm(corpus):
    settings = [
        "task.name='causal-lm'",
        f"task.path='{corpus}'",
        "task.max_len=8",
        "model.source='hf'",
        "model.path='{root}/model'",
        "model.moe_layers=[1]",
        "train.max_steps=2",
        "train.global_batch_size=4",
        "adaptive.enabled=false",
    ]
    return [f"--set={setting}" for setting in settings] + QUIET


# (id, dynmoe-train arguments ({root}: the user_files directory), a fragment of the one error line,
#  whether only the running ranks can see it: the others are refused by the launcher before any rank starts)
TORCHRUN_CASES = [
    ("unknown-key", ["--set=train.learning_rate=0.1"], "unknown key train.learning_rate; valid keys", False),
    ("missing-corpus", _causal_lm("{root}/nope.jsonl"), "task.path ('{root}/nope.jsonl') does not exist", False),
    ("ep-size", ["--set=parallel.ep_size=3"], "parallel.ep_size (3) does not divide the world size (2)", False),
    ("no-checkpoint", ["--resume={root}/missing"], "output.resume ('{root}/missing') is not a checkpoint", False),
    ("wrong-text-column", _causal_lm("{root}/body.jsonl"), "body.jsonl:1: no key 'text' (task.text_field)", True),
    ("corrupt-checkpoint", ["--resume={root}/corrupt_ckpt"], "corrupt_ckpt/meta.pt is corrupt or unreadable", True),
]


def torchrun_2(args, root, out_dir, **env):
    """`sh launcher/torchrun.sh 2 ARGS` as typed (MASTER_ADDR and the interpreter as the README sets them)."""
    filled = [arg.replace("{root}", str(root)) for arg in args]
    environment = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", **env}
    if "DYNMOE_TRACEBACK" not in env:
        environment.pop("DYNMOE_TRACEBACK", None)
    base = [] if "--set=task.name='causal-lm'" in args else TINY_RUN
    command = ["sh", "launcher/torchrun.sh", "2", *base, *filled, f"--out-dir={out_dir}"]
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(
    "args, fragment, after_start", [c[1:] for c in TORCHRUN_CASES], ids=[c[0] for c in TORCHRUN_CASES]
)
def test_torchrun_mistake_is_one_line_and_exit_status_2(args, fragment, after_start, user_files, tmp_path):
    started = time.monotonic()
    done = torchrun_2(args, user_files, tmp_path / "out")
    output = (done.stdout + done.stderr).strip()
    lines = output.splitlines()
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    # One error line, the last one (what `| tail -1` shows), naming the mistake.
    assert [line for line in lines if "error" in line.lower()] == lines[-1:], output[-3000:]
    assert lines[-1].startswith("dynmoe-train: error: ") and fragment.replace("{root}", str(user_files)) in lines[-1]
    if not after_start:
        assert lines == lines[-1:], output  # refused before any rank started: nothing else at all
    print(f"{'after' if after_start else 'before'} the ranks start: {time.monotonic() - started:.1f} s")


def test_a_crash_still_shows_its_traceback(user_files, tmp_path):
    """A rank that fails in another way (here: the error escape hatch) prints its own traceback, and the
    launcher names the rank that failed first, with torchrun's exit status 1."""
    args = _causal_lm("{root}/body.jsonl")
    done = torchrun_2(args, user_files, tmp_path / "out", DYNMOE_TRACEBACK="1")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "ValueError" in done.stderr and "no key 'text'" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"dynmoe-train: rank [01] failed \(exit status 1\); its output is above", last), last
    assert "ChildFailedError" not in done.stderr
