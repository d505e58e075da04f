"""`python -m dynmoe_dist.bench data --tiny`: the whole pipeline (generate, prepare, reuse, a 2-rank torchrun
start) at 1 and 2 MB, and the generated corpus is deterministic."""

import json
import subprocess
import sys

import pytest

from dynmoe_dist.bench.data import VOCAB_SIZE, parse, vocabulary, write_corpus


def test_corpus_is_deterministic_and_sized(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    made = write_corpus(a, 200_000)
    write_corpus(b, 200_000)
    assert a.read_bytes() == b.read_bytes() and made["corpus_bytes"] == a.stat().st_size >= 200_000
    docs = [json.loads(line)["text"].split() for line in a.read_text().splitlines()]
    assert len(docs) == made["corpus_docs"] and all(50 <= len(d) <= 500 for d in docs)
    assert len(set(vocabulary())) == VOCAB_SIZE and set(w for d in docs for w in d) <= set(vocabulary())


def test_bad_sizes_are_one_line_errors(capsys):
    for sizes in ("x", "0,1", "-1"):
        with pytest.raises(SystemExit) as stop:
            parse(["--sizes-gb", sizes])
        assert stop.value.code == 2 and f"--sizes-gb ('{sizes}') must be" in capsys.readouterr().err
    assert parse(["--tiny"]).sizes == [0.001, 0.002] and parse(["--sizes-gb", "1,0.1"]).sizes == [0.1, 1.0]


@pytest.mark.slow  # two torchrun starts and two prepares: ~2 min on 2 busy cores, as bench checkpoint's tiny run
def test_tiny_run(tmp_path):
    out = tmp_path / "data.json"
    cmd = [sys.executable, "-m", "dynmoe_dist.bench", "data", "--tiny", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result and result["benchmark"] == "data"
    assert [s["size_gb"] for s in result["sizes"]] == [0.001, 0.002]
    small, large = result["sizes"]
    for size in result["sizes"]:
        assert size["num_tokens"] > size["corpus_docs"] > 0 and size["prepare_tokens_per_s"] > 0
        assert size["second_prepare_reused"] is True
        assert [r["rank"] for r in size["ranks"]] == [0, 1]
        for rank in size["ranks"]:
            assert 0 < rank["data_open_s"] < rank["startup_s"] and rank["model_load_s"] > 0
            assert rank["peak_rss_mb"] > 100 and rank["num_train_windows"] > 0
    assert (
        large["num_tokens"] > small["num_tokens"]
        and large["ranks"][0]["num_train_windows"] > small["ranks"][0]["num_train_windows"]
    )
    assert set(result["meets_targets"]) == {"startup_s", "rss_growth"}
