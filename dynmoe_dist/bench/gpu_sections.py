"""The sections of ``python -m dynmoe_dist.bench gpu``, in the order they run, with their time caps.

The caps add up to more than the total budget (bench/gpu.py TOTAL_BUDGET_S) on purpose: a section that
finishes early leaves its time to the next; one that hangs loses only its own cap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from dynmoe_dist.bench import gpu_hf_moe, gpu_layer, gpu_train
from dynmoe_dist.bench import hf as hf_bench
from dynmoe_dist.bench.gpu_runner import Section, Skip

# What the GPU machine has, besides the standard library (and torch's own dependencies).
ALLOWED_IMPORTS = {
    "torch",
    "triton",
    "numpy",
    "transformers",
    "safetensors",
    "tokenizers",
    "tensorboard",
    "matplotlib",
    "dynmoe_dist",
}
CHECKED_PACKAGES = (
    "triton",
    "numpy",
    "transformers",
    "safetensors",
    "tokenizers",
    "tensorboard",
    "matplotlib",
    "tqdm",
    "ray",
    "fairscale",
    "pytest",
)


def make_context(out_dir: Path, rehearsal: bool = False, modules_at_start=None) -> dict:
    """``rehearsal``: run every section on CPU at toy sizes (for the CPU tests: it exercises the code
    the GPU machine will run, without a GPU)."""
    cuda = torch.cuda.is_available()
    return {
        "out_dir": out_dir.resolve(),
        "cuda": cuda,
        "rehearsal": rehearsal,
        "device": "cuda" if cuda and not rehearsal else "cpu",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "modules_at_start": set(sys.modules) if modules_at_start is None else set(modules_at_start),
    }


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "installed" if importlib.util.find_spec(name) else "missing"


def environment(context: dict) -> Dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": context["cuda"],
        "torch_cuda": torch.version.cuda,
        "packages": {name: _version(name) for name in CHECKED_PACKAGES},
    }
    if context["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    device = info.get("device", "no CUDA device")
    info["summary"] = f"{device}; torch {torch.__version__}; triton {info['packages']['triton']}"
    return info


def kernel_checks(context: dict) -> Dict:
    from dynmoe_dist.kernels import checks, select

    if not select.triton_available():
        raise Skip("triton is not installed")
    if context["device"] != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("Triton runs on CPU only under TRITON_INTERPRET=1")
    from dynmoe_dist.kernels import permute_triton

    # float64 on CPU only: on CUDA every dtype is another set of Triton compilations (about a second
    # each), and the float64 path matters for the CPU references, not for training.
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if context["device"] != "cuda" else [])
    results = checks.check_all(permute_triton, context["device"], dtypes)
    failed = [f"{r['kernel']} {r['case']} {r['dtype']}" for r in results if not r["passed"]]
    return {
        "passed": not failed,
        "results": results,
        "failed": failed,
        "selected_on_cuda": select.kernel_mode(),
        "summary": f"{len(results) - len(failed)}/{len(results)} kernel cases match the torch reference",
    }


def _requirement_names(distribution: str) -> List[str]:
    """Distribution names a distribution requires (extras left out); [] if it is not installed."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    names = []
    for requirement in requirements:
        if "extra ==" in requirement.replace("extra==", "extra =="):
            continue
        name = requirement.split(";")[0].split("[")[0].strip()
        for cut in "<>=!~ (":
            name = name.split(cut)[0]
        names.append(name)
    return names


def torch_requirements() -> set:
    """Import names of what torch and triton pull in (sympy, mpmath, networkx, jinja2, markupsafe, the
    nvidia-* CUDA libraries, ...), transitively: torch imports some of them lazily."""
    seen, todo = set(), ["torch", "triton"]
    while todo:
        name = todo.pop().replace("_", "-").lower()
        if name not in seen:
            seen.add(name)
            todo += _requirement_names(name)
    names = {n.replace("-", "_") for n in seen}
    # CUDA libraries ship as nvidia-<lib>-cu12 distributions inside one "nvidia" namespace package.
    return names | ({"nvidia"} if any(n.startswith("nvidia") for n in names) else set())


# What the HF sections make transformers load (its models, their loading): the packages transformers itself
# imports there are its business, not ours (on the GPU machine it takes pandas, sklearn, torchvision, ... where
# they are installed).
HF_STACK_PROBE = (
    "import sys, transformers\n"
    "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer\n"
    "import transformers.models.llama.modeling_llama, transformers.models.qwen3_moe.modeling_qwen3_moe\n"
    "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))"
)


def hf_stack_imports() -> set:
    """Top-level packages a fresh interpreter holds after importing the HF stack the way the sections use it
    (empty where transformers is not installed)."""
    if importlib.util.find_spec("transformers") is None:
        return set()
    done = subprocess.run([sys.executable, "-c", HF_STACK_PROBE], capture_output=True, text=True, timeout=120)
    return set(done.stdout.split()) if done.returncode == 0 else set()


def import_set(context: dict) -> Dict:
    """Top-level packages this run imported beyond the standard library, torch's own, the HF stack's own and the
    allowed."""
    stdlib = set(sys.stdlib_module_names) | {"cython_runtime"}  # created by every Cython extension
    top = lambda names: {n.split(".")[0] for n in names if not n.startswith("_")}  # noqa: E731
    ours = top(set(sys.modules) - context["modules_at_start"]) - stdlib - ALLOWED_IMPORTS
    torch_own = (top(context["modules_at_start"]) - stdlib) | torch_requirements()
    unexpected = sorted(ours - torch_own - hf_stack_imports())
    return {
        "passed": not unexpected,
        "unexpected": unexpected,
        "allowed": sorted(ALLOWED_IMPORTS),
        "summary": "only allowed packages imported" if not unexpected else f"unexpected imports: {unexpected}",
    }


SECTIONS = (
    Section("environment", environment, cap_s=20, needs_cuda=False, what="versions, device, packages present"),
    Section(
        "triton_kernels",
        kernel_checks,
        cap_s=90,
        what="every Triton kernel vs its torch reference, forward and backward, fp32/bf16 (+fp64 on CPU)",
    ),
    Section(
        "layer_correctness",
        gpu_layer.layer_correctness,
        cap_s=60,
        what="MoELayer fwd+bwd on CUDA (top_any/top_k/top_p, k=0 tokens, empty experts) vs CPU float64",
    ),
    Section(
        "grouped_mm_vs_loop",
        gpu_layer.grouped_vs_loop,
        cap_s=30,
        what="torch._grouped_mm expert path vs the per-expert loop",
    ),
    Section(
        "trainer",
        gpu_train.trainer_runs,
        cap_s=150,
        what="demo + quick-start on CUDA/NCCL, adaptive event, checkpoint and resume",
    ),
    Section("host_syncs", gpu_train.host_syncs, cap_s=45, what="CUDA syncs of one training step vs the budget"),
    Section(
        "throughput",
        gpu_layer.throughput,
        cap_s=120,
        what="bf16 MoE layer vs dense FFN (same active parameters), top-any vs top-k, D=2048 F=5632 T=16k",
    ),
    Section(
        "hf_smollm2",
        hf_bench.gpu_step_tokens_per_s,
        cap_s=60,
        what="upcycled SmolLM2-shaped LLaMA (4 blocks, 4 top-1 experts each), bf16 training step tokens/s",
    ),
    Section(
        "imported_moe",
        gpu_hf_moe.imported_moe,
        cap_s=90,
        what="imported Qwen3-MoE: first loss vs transformers', bf16 step ours/transformers, LoRA trains only adapters",
    ),
    Section(
        "import_set",
        import_set,
        cap_s=40,
        needs_cuda=False,
        what="nothing imported beyond torch, triton, numpy, the HF stack (and its imports), tensorboard, matplotlib",
    ),
)
