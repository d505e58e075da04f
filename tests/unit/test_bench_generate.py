"""bench generate: the summary (hand-worked), the option checks, and one tiny real run of the CLI on an
exported LLaMA against its dense base (a subprocess: the remote code goes into its own modules cache)."""

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from hf_remote_cases import base_model, export_case

from dynmoe_dist.bench.generate import check, summarize


def test_summary_medians_and_ratio():
    # moe per-token medians: [3, 4, 5] ms -> 4; dense: [2, 2.5, 1] -> 2; ratio 2.0
    runs = {
        "dense": [{"prefill_s": 0.010, "per_token_s": t} for t in (0.002, 0.0025, 0.001)],
        "moe": [{"prefill_s": 0.020, "per_token_s": t} for t in (0.003, 0.004, 0.005)],
    }
    out = summarize(runs)
    assert out["cases"]["moe"] == {"prefill_ms_median": 20.0, "per_token_ms_median": 4.0, "per_token_ms_min": 3.0}
    assert out["cases"]["dense"]["per_token_ms_median"] == 2.0 and out["moe_over_dense_per_token"] == 2.0


def options(model, **overrides):
    return Namespace(
        **{
            **dict(model=str(model), base=None, prompt_tokens=4, new_tokens=4, batch=1, repeats=1, threads=1),
            **overrides,
        }
    )


def test_bad_options_are_one_line_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--new-tokens \(1\) must be >= 2"):
        check(options(tmp_path, new_tokens=1))
    with pytest.raises(ValueError, match=r"--model \('.*'\) has no config.json"):
        check(options(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dynmoe": {"format": 1}}))
    with pytest.raises(
        ValueError, match=r"no format-2 or 3 export .* python -m dynmoe_dist.export CHECKPOINT --out DIR"
    ):
        check(options(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"dynmoe": {"format": 2}}))
    with pytest.raises(ValueError, match=r"--base is needed: .* records no dynmoe.base_model"):
        check(options(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"dynmoe": {"format": 2, "base_model": "/models/base"}}))
    args = options(tmp_path)
    check(args)
    assert args.base == "/models/base"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))  # a stock export: no base needed
    args = options(tmp_path)
    check(args)
    assert args.base is None


def test_tiny_run_prints_json(tmp_path):
    export_case(tmp_path / "moe", "llama", torch.float32, "top1")
    base_model("llama", 16).save_pretrained(tmp_path / "base")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dynmoe_dist.bench", "generate", "--model", str(tmp_path / "moe")]
    cmd += [
        "--base",
        str(tmp_path / "base"),
        "--prompt-tokens",
        "4",
        "--new-tokens",
        "3",
        "--repeats",
        "2",
        "--threads",
        "1",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "generate" and result["new_tokens"] == 3
    for case in ("dense", "moe"):
        assert result["cases"][case]["per_token_ms_median"] > 0 and result["cases"][case]["prefill_ms_median"] > 0
    assert result["moe_over_dense_per_token"] > 0
