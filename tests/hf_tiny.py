"""A tiny LLaMA and a word-level tokenizer, built offline, for the Hugging Face tests (unit, distributed,
integration, cluster), and the tiny adaptive run on them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

WORDS = "the cat dog sat ran on a mat log red big small and then".split()
NUM_LAYERS = 3


def corpus_lines(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(length),), generator=g))
        for length in torch.randint(3, 12, (n,), generator=g)
    ]


def save_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return len(vocab)


def save_llama(directory, vocab_size):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(directory)


def write_tiny_run(root):
    """The tiny LLaMA + tokenizer in root/model and its text in root/corpus.txt: (model dir, text file)."""
    root = Path(root)
    model_dir, text_file = root / "model", root / "corpus.txt"
    save_llama(model_dir, save_tokenizer(model_dir))
    text_file.write_text("\n".join(corpus_lines()) + "\n")
    return str(model_dir), str(text_file)


STEPS = 12
# Every 3 steps an event (after steps 2, 5, 8, 11). 5 experts with a sparse start (threshold 0.3): some
# experts get no token in a window (removed) while some tokens find no expert (one added). min_experts = 3
# keeps at least one expert per rank at ep 3.
ADAPTIVE = ["moe.num_experts=5", "moe.min_experts=3", "moe.threshold_init=0.3", "adaptive.period_steps=3"]


def hf_model_settings(model_dir, text_file):
    """The tiny LLaMA upcycled in blocks 1 and 2, as a causal LM on text_file: the task and model overrides."""
    return [
        "task.name='causal-lm'",
        f"task.path='{text_file}'",
        "task.max_len=8",
        "model.source='hf'",
        f"model.path='{model_dir}'",
        # model.num_layers is read from the model (NUM_LAYERS blocks)
        "model.moe_layers=[1, 2]",
    ]


def hf_settings(model_dir, text_file, steps=STEPS):
    """The tiny adaptive run as --set overrides (distributed, torchrun and Ray tests)."""
    return [
        *hf_model_settings(model_dir, text_file),
        "model.freeze=['model.embed_tokens', 'model.layers.0']",
        *ADAPTIVE,
        "train.precision='float64'",
        f"train.max_steps={steps}",
        "train.global_batch_size=6",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
    ]


def train(cmd_prefix, out_dir, settings):
    """Run a training command (`python -m dynmoe_dist.train`, `launcher/torchrun.sh N`) with --set settings;
    its metrics.jsonl records."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    out_dir = Path(out_dir)
    cmd = [*cmd_prefix, "--out-dir", str(out_dir)]
    for setting in settings:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def changes(records):
    """(step, layer, removed, added ids, expert count) of each event that removed or added experts: what
    must agree across world sizes. Moves and imbalance depend on the ep size, and so does whether a layer
    whose experts only moved logs an event at all."""
    return [
        (r["step"], r["layer"], r["removed"], [a["expert"] for a in r["added"]], r["num_experts"])
        for r in records
        if r["kind"] == "event" and (r["removed"] or r["added"])
    ]


def train_recorded(trainer, steps):
    """Train `steps` steps with a collective coordinator -> (adaptive controller, losses, expert counts,
    changes of the events), what the HF invariance tests compare across world sizes."""
    from dynmoe_dist.coordination import CollectiveCoordinator
    from dynmoe_dist.train.adaptive import AdaptiveController
    from dynmoe_dist.train.run import step_once

    adaptive = AdaptiveController(trainer, CollectiveCoordinator(trainer.groups))
    losses, counts, events = [], [], []
    for _ in range(steps):
        record, new_events = step_once(trainer, adaptive)
        losses.append(record["loss"])
        counts.append(record["num_experts"])
        events += changes(new_events)  # removals and additions (moves depend on the ep size)
    return adaptive, losses, counts, events
