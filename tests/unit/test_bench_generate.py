"""bench generate: the summary and the comparison against a native export (hand-worked), the decode-k count,
the option checks, one tiny real run of the CLI on an exported LLaMA against its dense base and one on a
top-any export of a Qwen3-MoE against its native export, and one --build of a tiny pair (subprocesses: the remote
code goes into its own modules cache)."""

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.nn as nn
from hf_remote_cases import base_model, export_case
from hf_tiny import randomize, tiny_model

from dynmoe_dist.bench.decode_pair import TINY, build_pair
from dynmoe_dist.bench.generate import DecodeK, against_native, check, summarize
from dynmoe_dist.hf import import_moe
from dynmoe_dist.models.hf.pretrained import dynmoe_section, save_exported
from dynmoe_dist.moe.config import MoEConfig


def test_summary_medians_and_ratio():
    # moe per-token medians: [3, 4, 5] ms -> 4; dense: [2, 2.5, 1] -> 2; ratio 2.0
    runs = {
        "dense": [{"prefill_s": 0.010, "per_token_s": t} for t in (0.002, 0.0025, 0.001)],
        "moe": [{"prefill_s": 0.020, "per_token_s": t} for t in (0.003, 0.004, 0.005)],
    }
    out = summarize(runs)
    assert out["cases"]["moe"] == {"prefill_ms_median": 20.0, "per_token_ms_median": 4.0, "per_token_ms_min": 3.0}
    assert out["cases"]["dense"]["per_token_ms_median"] == 2.0 and out["moe_over_dense_per_token"] == 2.0


def test_against_native_hand_worked():
    # native medians 2 ms, export 1.8 ms: 0.9; k 1.75 of top-2: FLOPs 0.875, target 0.925, 0.9 / 0.925 = 0.973
    runs = {
        "native": [{"prefill_s": 0.01, "per_token_s": t} for t in (0.002, 0.003, 0.001)],
        "export": [{"prefill_s": 0.01, "per_token_s": t} for t in (0.0018, 0.0018, 0.004)],
    }
    out = against_native(runs, mean_k=1.75, native_k=2)
    assert out["cases"]["native"]["per_token_ms_median"] == 2.0 and out["cases"]["export"]["per_token_ms_median"] == 1.8
    assert (out["mean_k"], out["flops_ratio"], out["time_ratio"]) == (1.75, 0.875, 0.9)
    assert out["target_ratio"] == 0.925 and out["time_over_target"] == 0.973 and out["meets_target"] is True
    assert against_native(runs, mean_k=1.5, native_k=2)["meets_target"] is False  # 0.9 > 0.8


class Routed(nn.Module):
    """Stands in for an export: generate() calls its one router on a prefill of 3 tokens, then 2 decode steps."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.ModuleDict({"moe": nn.ModuleDict({"router": Threshold()})})

    def generate(self, *args, **kwargs):
        router = self.mlp["moe"]["router"]
        router(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))  # prefill: 3 each, left out
        router(torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 1.0]]))  # 2 and 1
        router(torch.tensor([[-1.0, -1.0, -1.0], [1.0, -1.0, -1.0]]))  # 0 and 1


class Threshold(nn.Module):
    def forward(self, x_TE):
        return x_TE > 0, x_TE


def test_decode_k_counts_the_decode_steps_only():
    model = Routed()
    assert DecodeK(model).mean_k(torch.zeros(2, 3, dtype=torch.long), 3) == 1.0  # (2 + 1 + 0 + 1) / 4
    assert not model.mlp["moe"]["router"]._forward_hooks  # the hooks go again
    with pytest.raises(ValueError, match="no MoE routers"):
        DecodeK(nn.Linear(2, 2))


def options(model, **overrides):
    return Namespace(
        **{
            "model": None if model is None else str(model),
            **dict(base=None, native=None, prompt_tokens=4, new_tokens=4, batch=None, repeats=1),
            **dict(build=None, tiny=False, target_k=0.0, seed=0),
            "threads": 1,
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
    assert args.base is None and args.batch == [1]
    with pytest.raises(ValueError, match=r"--batch \(1 16\): one value without --native"):
        check(options(tmp_path, batch=[1, 16]))
    with pytest.raises(ValueError, match=r"--batch \(0\) must be >= 1"):
        check(options(tmp_path, batch=[0]))


def test_bad_native_options_are_one_line_value_errors(tmp_path):
    export, native = tmp_path / "export", tmp_path / "native"
    export.mkdir(), native.mkdir()
    (export / "config.json").write_text(json.dumps({"dynmoe": {"format": 3}}))
    with pytest.raises(ValueError, match=r"--native \('.*native'\) has no config.json"):
        check(options(export, native=str(native)))
    with pytest.raises(ValueError, match=r"--base \('/b'\) and --native \('.*'\): give one"):
        check(options(export, native=str(native), base="/b"))
    (native / "config.json").write_text(json.dumps({"dynmoe": {"format": 3}}))
    with pytest.raises(ValueError, match=r"--native \('.*'\) is a DynMoE export"):
        check(options(export, native=str(native)))
    (native / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=r"--native \('.*'\): config.json gives no num_experts_per_tok"):
        check(options(export, native=str(native)))
    (native / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts_per_tok": 2}))
    with pytest.raises(ValueError, match=r"--model \('.*native'\) is no DynMoE export"):
        check(options(native, native=str(native)))
    args = options(export, native=str(native))
    check(args)
    assert args.batch == [1, 16] and args.base is None


def run_cli(tmp_path, *args):
    """The CLI's JSON for one repeat of 3 new tokens. Its decode times are differences of two timed runs, which a
    loaded machine can make negative: the tests check their presence, never their sign."""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dynmoe_dist.bench", "generate", *args]
    cmd += ["--prompt-tokens", "4", "--new-tokens", "3", "--repeats", "1", "--threads", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tiny_run_prints_json(tmp_path):
    export_case(tmp_path / "moe", "llama", torch.float32, "top1")
    base_model("llama", 16).save_pretrained(tmp_path / "base")
    result = run_cli(tmp_path, "--model", str(tmp_path / "moe"), "--base", str(tmp_path / "base"))
    assert result["benchmark"] == "generate" and result["new_tokens"] == 3 and result["batch"] == 1
    for case in ("dense", "moe"):  # a decode time is a difference of two timings: no sign (run_cli)
        assert isinstance(result["cases"][case]["per_token_ms_median"], float)
        assert result["cases"][case]["prefill_ms_median"] > 0
    assert isinstance(result["moe_over_dense_per_token"], float)


def test_tiny_run_against_the_native_export(tmp_path):
    model = randomize(tiny_model("qwen3_moe", 48)).eval()
    model.save_pretrained(tmp_path / "native")  # the stock directory: transformers' own experts and top-k
    moe = MoEConfig(router="top_any", combine="softmax")
    import_moe(model, moe)
    save_exported(model, dynmoe_section(model, moe), tmp_path / "top_any")
    result = run_cli(
        tmp_path, "--model", str(tmp_path / "top_any"), "--native", str(tmp_path / "native"), "--batch", "1", "3"
    )
    assert result["native_k"] == model.config.num_experts_per_tok and set(result["batches"]) == {"1", "3"}
    for out in result["batches"].values():
        assert all(isinstance(out["cases"][case]["per_token_ms_median"], float) for case in ("native", "export"))
        assert 0 < out["mean_k"] <= model.config.num_experts
        assert out["flops_ratio"] == round(out["mean_k"] / result["native_k"], 4)
        assert out["target_ratio"] == round(out["flops_ratio"] + 0.05, 4) and isinstance(out["meets_target"], bool)


def test_bad_build_options_are_one_line_value_errors(tmp_path):
    with pytest.raises(ValueError, match=r"--model \(an exported directory\) or --build \(DIR\) is needed"):
        check(options(None))
    with pytest.raises(ValueError, match=r"--native \('/n'\) and --build \('.*'\): --build makes the models"):
        check(options(None, native="/n", build=str(tmp_path)))
    with pytest.raises(ValueError, match=r"--target-k \(9.0\) must be in \(0, num_experts \(8\)\]"):
        check(options(None, build=str(tmp_path), tiny=True, target_k=9.0))
    with pytest.raises(ValueError, match=r"--target-k \(1.5\) goes with --build DIR only"):
        check(options(tmp_path, target_k=1.5))
    args = options(None, build=str(tmp_path), tiny=True)
    check(args)
    assert args.batch == [1, 16]
    with pytest.raises(ValueError, match=r"--batch \(1 16\): one value without --native or --build"):
        check(options(tmp_path, batch=[1, 16]))


def test_tiny_built_pair_against_its_native(tmp_path):
    """--build: the stock model, its top-1 view and its top-any export at target k 1.5 are built, load and are
    timed; the export's decode k is near the budget, the view's is 1; a second build of the same settings is
    the first, one of other settings is refused."""
    pair = tmp_path / "pair"
    result = run_cli(tmp_path, "--build", str(pair), "--tiny", "--target-k", "1.5", "--batch", "1", "4")
    built = result["built"]
    assert result["model"] == built["export"] == str(pair / "export") and result["native"] == built["native"]
    assert built["target_k"] == 1.5 and built["calibrated_k"] == pytest.approx([1.5, 1.5], rel=0.03)
    assert 0 < built["expert_share"] < 1 and 0 < built["decode_expert_share"] < built["expert_share"]
    assert result["native_k"] == 2 and set(result["batches"]) == set(result["sanity"]["batches"]) == {"1", "4"}
    for out in result["batches"].values():
        assert out["mean_k"] == pytest.approx(1.5, abs=0.5) and out["flops_ratio"] == round(out["mean_k"] / 2, 4)
        assert isinstance(out["cases"]["export"]["per_token_ms_median"], float)  # no sign (run_cli)
        assert isinstance(out["meets_target"], bool)
    for out in result["sanity"]["batches"].values():  # the native top-1 view: k 1, half the FLOPs
        assert (out["mean_k"], out["flops_ratio"], out["target_ratio"]) == (1.0, 0.5, 0.55)
    configs = {name: json.loads((pair / path / "config.json").read_text()) for name, path in PAIR_DIRS.items()}
    assert configs["view"]["num_experts_per_tok"] == 1 and configs["native"]["num_experts_per_tok"] == 2
    assert "dynmoe" in configs["export"] and "dynmoe" not in configs["native"]
    again = build_pair(pair, TINY, 1.5, 0)
    assert {k: again[k] for k in built} == built
    with pytest.raises(ValueError, match=r"--build \('.*pair'\) holds a pair built with other settings"):
        build_pair(pair, TINY, 1.0, 0)


PAIR_DIRS = {"native": "native", "view": "views/k1", "export": "export"}
