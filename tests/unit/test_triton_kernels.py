"""The fused Triton permute kernels vs their torch references, on CPU under TRITON_INTERPRET=1.

The interpreter flag is read when triton decorates a kernel, so the kernels run in a fresh
subprocess that sets it before importing anything (this test process may import triton otherwise).
Skipped when triton is not installed (it is the optional `triton` extra; `make setup` installs it).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dynmoe_dist.kernels import select

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHILD = r"""
import json, torch
from dynmoe_dist.kernels import checks, permute_triton
results = checks.check_all(permute_triton, "cpu", [torch.float64, torch.float32, torch.bfloat16])

# The MoE layer end to end with the Triton gather/combine (DYNMOE_KERNELS=triton) vs the torch path.
import os
from dynmoe_dist.moe import MoEConfig, MoELayer
def run(mode):
    os.environ["DYNMOE_KERNELS"] = mode
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=16, num_experts=4, router="top_any", threshold_init=0.3)).double()
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    (out.output.square().sum() + out.aux_loss).backward()
    return [out.output.detach(), x.grad] + [p.grad for p in layer.parameters() if p.grad is not None], out.routing
mine, routing = run("triton")
theirs, _ = run("torch")
layer_err = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
k_T = routing.num_selected
print(json.dumps({"kernels": results, "layer_err": layer_err, "layer_has_k0": bool((k_T == 0).any()),
                  "layer_num_grads": len(mine)}))
"""


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
def test_every_kernel_matches_its_reference_forward_and_backward(interpreted):
    results = interpreted["kernels"]
    # 5 cases (k = 0 tokens, R = 0, T = 0, several D blocks) x 3 dtypes x 2 kernels
    assert len(results) == 30
    failed = [r for r in results if not r["passed"]]
    assert not failed, failed


@needs_triton
def test_moe_layer_with_triton_kernels_matches_torch_path(interpreted):
    assert interpreted["layer_has_k0"], "the case should include a token that selects no expert"
    assert interpreted["layer_num_grads"] >= 4
    assert interpreted["layer_err"] < 1e-12


def test_selection_is_torch_on_cpu_by_default(monkeypatch):
    monkeypatch.delenv("DYNMOE_KERNELS", raising=False)
    assert select.permute_kernels(torch.zeros(2, 2)) is None
    monkeypatch.setenv("DYNMOE_KERNELS", "torch")
    assert select.permute_kernels(torch.zeros(2, 2)) is None


def test_selection_rejects_unknown_mode(monkeypatch):
    monkeypatch.setenv("DYNMOE_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"DYNMOE_KERNELS \('cuda'\)"):
        select.permute_kernels(torch.zeros(1))


def test_forced_triton_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setenv("DYNMOE_KERNELS", "triton")
    monkeypatch.setattr(select, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[triton\]'"):
        select.permute_kernels(torch.zeros(1))
