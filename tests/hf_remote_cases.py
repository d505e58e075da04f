"""Tiny upcycled LLaMA / Qwen2 / Mistral / GPT-2 models with non-trivial routing, exported in format 2, for
tests/unit/test_hf_remote.py (built from configs: nothing is downloaded).

Every expert gets its own weights and every router distinct thresholds, so tokens select 0, 1 or several
experts: the combine, the eval k = 0 rule ('top1' and 'skip') and the expert choice all show in the logits.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hf_tiny import save_tokenizer, tiny_model

from dynmoe_dist.hf import upcycle_hf
from dynmoe_dist.models.hf.pretrained import dynmoe_section, save_exported
from dynmoe_dist.moe.config import MoEConfig
from dynmoe_dist.moe.layer import find_moe_layers

TESTS = Path(__file__).resolve().parent
ARCHS = ("llama", "qwen2", "mistral", "gpt2")
BLOCKS = [0, 2]
NUM_EXPERTS = 3
THRESHOLDS = [0.05, 0.25, 0.45]  # top-any selects e where cos(x, W_e) > G_e: some tokens pick none


def base_model(arch: str, vocab_size: int, seed: int = 0):
    """The tiny model of the family; EOS is token 1 (the word-level tokenizer's), no BOS."""
    return tiny_model(arch, vocab_size, seed, eos_token_id=1, bos_token_id=None).eval()


def moe_model(arch: str, vocab_size: int, dtype: torch.dtype, eval_k0: str, seed: int = 0):
    """(the upcycled model in eval mode with distinct experts and thresholds, its MoEConfig)."""
    model = base_model(arch, vocab_size, seed).to(dtype)
    moe = MoEConfig(num_experts=NUM_EXPERTS, eval_k0=eval_k0)
    upcycle_hf(model, moe, layers=BLOCKS)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, layer in find_moe_layers(model):
            layer.router.weight.normal_(0, 1, generator=g)
            layer.router.threshold.copy_(torch.tensor(THRESHOLDS))
            for p in layer.experts.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model.eval(), moe


def export_case(directory, arch: str, dtype: torch.dtype, eval_k0: str, seed: int = 0):
    """Write the case's directory (with a tokenizer); return the dynmoe_dist model it was written from."""
    vocab_size = save_tokenizer(directory)
    model, moe = moe_model(arch, vocab_size, dtype, eval_k0, seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    save_exported(model, dynmoe_section(model, moe, BLOCKS), directory, tokenizer)
    return model


def sample_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed))


def run_remote_check(root, manifest):
    """tests/remote_check.py on the manifest, in a process that cannot import dynmoe_dist: its results."""
    (root / "manifest.json").write_text(json.dumps(manifest))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(root / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(TESTS / "remote_check.py"), str(root / "manifest.json"), str(root / "result.pt")],
        cwd=root,  # not the repository root, where dynmoe_dist would be importable as a plain directory
        env=env,
        stdin=subprocess.DEVNULL,  # transformers' trust prompt then fails at once instead of waiting 15 s
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(root / "result.pt", weights_only=False)
