"""`python -m dynmoe_dist.bench generate --model DIR [--base BASE]`: time per new token of an exported DynMoE
model, loaded the way users load it (plain ``AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)``), against the dense base model it was upcycled from.

Both generate greedily with the KV cache from the same random prompt, a fixed number of new tokens
(``min_new_tokens`` = ``max_new_tokens``: no early stop at EOS). Per run, the prefill is timed as a
1-token generation and the decode as (N-token generation - 1-token generation) / (N - 1), so the
figure is the cost of one cached decode step; the runs alternate (dense, MoE, dense, ...) so load from
other processes hits both alike, and each figure is the median over ``--repeats`` runs. ``--base``
defaults to the export's recorded base model (``dynmoe.base_model`` in config.json: model.path of the
training run, a directory, a .gguf file or package:NAME). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, cast

import torch
import torch.nn as nn

from ..models.hf.loading import _transformers, load_model
from .measure import machine_info

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# option -> smallest value (two new tokens: the decode time is a difference of two generations)
MINIMUMS = {"prompt_tokens": 1, "new_tokens": 2, "batch": 1, "repeats": 1, "threads": 1}
REEXPORT = "re-export with: python -m dynmoe_dist.export CHECKPOINT --out DIR"
REMOTE_FORMATS = (2, 3)
"""Export formats whose remote code this transformers loads (models/hf/remote reads both)."""


def check(args: argparse.Namespace) -> None:
    """One-line ValueErrors for bad options, before any model is loaded; fills in ``args.base``."""
    for name, least in MINIMUMS.items():
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= {least}")
    config_file = Path(args.model) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model ({args.model!r}) has no config.json: expected an exported directory")
    raw = json.loads(config_file.read_text())
    if "dynmoe" not in raw:
        return  # a stock directory (an imported MoE exported with its own routing): --base is optional
    section = raw["dynmoe"]
    if not isinstance(section, dict) or section.get("format") not in REMOTE_FORMATS:
        raise ValueError(
            f"--model ({args.model!r}) is no format-{' or '.join(map(str, REMOTE_FORMATS))} export (plain "
            f"transformers cannot load it); {REEXPORT}"
        )
    if args.base is None:
        args.base = section.get("base_model")
        if not args.base:
            raise ValueError(f"--base is needed: {config_file} records no dynmoe.base_model")


def load_export(directory: str) -> nn.Module:
    """The export as plain transformers loads it: remote code for a DynMoE export, the stock class otherwise."""
    tf = _transformers()
    remote = "dynmoe" in json.loads((Path(directory) / "config.json").read_text())
    return tf.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote, local_files_only=True).eval()


def vocab_size(model: nn.Module) -> int:
    return int(cast("PreTrainedModel", model).config.vocab_size)  # an HF model


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generation_times(model: nn.Module, prompt_BL: torch.Tensor, new_tokens: int) -> Dict[str, float]:
    """(prefill seconds, seconds per cached decode step) of one run."""

    def run(n: int) -> object:
        return model.generate(  # type: ignore[operator]
            prompt_BL, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0
        )

    with torch.no_grad():
        prefill_s = timed(lambda: run(1))
        full_s = timed(lambda: run(new_tokens))
    return {"prefill_s": prefill_s, "per_token_s": (full_s - prefill_s) / (new_tokens - 1)}


def summarize(runs: Dict[str, List[Dict[str, float]]]) -> Dict:
    out: Dict = {"cases": {}}
    for name, times in runs.items():
        out["cases"][name] = {
            "prefill_ms_median": round(1e3 * statistics.median(t["prefill_s"] for t in times), 3),
            "per_token_ms_median": round(1e3 * statistics.median(t["per_token_s"] for t in times), 3),
            "per_token_ms_min": round(1e3 * min(t["per_token_s"] for t in times), 3),
        }
    cases = out["cases"]
    if "dense" in cases:
        out["moe_over_dense_per_token"] = round(
            cases["moe"]["per_token_ms_median"] / cases["dense"]["per_token_ms_median"], 3
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynmoe_dist.bench generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an exported directory (python -m dynmoe_dist.export)")
    parser.add_argument("--base", default=None, help="the dense base model (default: the export's dynmoe.base_model)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    try:
        check(args)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    torch.set_num_threads(args.threads)
    moe = load_export(args.model)
    dtype = next(moe.parameters()).dtype
    models = {"moe": moe}
    if args.base is not None:  # "dense": the base the export started from (for an imported MoE, an MoE too)
        models = {"dense": load_model(args.base, "causal-lm", field="--base").to(dtype).eval(), "moe": moe}
    vocab = min(vocab_size(model) for model in models.values())
    prompt_BL = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in models}
    for model in models.values():  # warm-up: first calls pay for allocations and lazy imports
        generation_times(model, prompt_BL, 2)
    for _ in range(args.repeats):
        for name, model in models.items():
            runs[name].append(generation_times(model, prompt_BL, args.new_tokens))
    result = {
        "benchmark": "generate",
        "model": args.model,
        "base": args.base,
        "dtype": str(dtype),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        **summarize(runs),
        "machine": machine_info(args.threads),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
