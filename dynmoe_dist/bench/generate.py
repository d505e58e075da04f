"""`python -m dynmoe_dist.bench generate --model DIR [--base BASE | --native NATIVE] | --build DIR`: time per new
token of an exported DynMoE model, loaded the way users load it (plain ``AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)``), against the dense base model it was upcycled from, or (``--native``) against the
native export of the same pre-trained MoE (its stock directory, transformers' own fused experts).

Both generate greedily with the KV cache from the same random prompt, a fixed number of new tokens
(``min_new_tokens`` = ``max_new_tokens``: no early stop at EOS). Per run, the prefill is timed as a
1-token generation and the decode as (N-token generation - 1-token generation) / (N - 1), so the
figure is the cost of one cached decode step; the runs alternate (dense, MoE, dense, ...) so load from
other processes hits both alike, and each figure is the median over ``--repeats`` runs. ``--base``
defaults to the export's recorded base model (``dynmoe.base_model`` in config.json: model.path of the
training run, a directory, a .gguf file or package:NAME). Prints one JSON object.

With ``--native`` it times both at every ``--batch`` (default 1 and 16) and reports, per batch, the export's
mean k over the decode steps (its routers' choices, counted in one more untimed generation), the FLOPs ratio
k / the native top-k, and the decode-time ratio against the target: export / native <= FLOPs ratio + 0.05.

With ``--build DIR`` (instead of --model and --native) it first builds, offline and from ``--seed``, a stock
Qwen3-MoE whose experts are most of a decode step, its native top-k/2 view and a top-any export of it made the
project's way (conversion run at the budget ``--target-k``, then ``python -m dynmoe_dist.export``; see
bench/decode_pair.py; reused on the next call), then times the export against the native as --native does, and
the view against the native under "sanity": whether any router can meet the target at that size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple, cast

import torch
import torch.nn as nn

from ..models.hf.loading import _transformers, load_model
from .measure import machine_info

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# option -> smallest value (two new tokens: the decode time is a difference of two generations)
MINIMUMS = {"prompt_tokens": 1, "new_tokens": 2, "repeats": 1, "threads": 1}
NATIVE_BATCHES = [1, 16]  # --batch's default with --native; one sequence otherwise
TARGET_SLACK = 0.05
"""The decode-time target with --native: export / native at most the FLOPs ratio plus this."""
REEXPORT = "re-export with: python -m dynmoe_dist.export CHECKPOINT --out DIR"
BUILD_ONLY = {"tiny": False, "target_k": 0.0, "seed": 0}
"""Options that only --build reads -> their defaults."""
REMOTE_FORMATS = (2, 3)
"""Export formats whose remote code this transformers loads (models/hf/remote reads both)."""


def check(args: argparse.Namespace) -> None:
    """One-line ValueErrors for bad options, before any model is loaded; fills in ``args.base`` and
    ``args.batch``."""
    for name, least in MINIMUMS.items():
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= {least}")
    check_batches(args)
    if args.build is not None:
        check_build(args)
        return
    for name, unset in BUILD_ONLY.items():
        if getattr(args, name) != unset:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) goes with --build DIR only")
    if args.model is None:
        raise ValueError("--model (an exported directory) or --build (DIR) is needed")
    section = read_config(args.model, "model").get("dynmoe")
    if section is not None and (not isinstance(section, dict) or section.get("format") not in REMOTE_FORMATS):
        raise ValueError(
            f"--model ({args.model!r}) is no format-{' or '.join(map(str, REMOTE_FORMATS))} export (plain "
            f"transformers cannot load it); {REEXPORT}"
        )
    if args.native is not None:
        check_native(args, exported=section is not None)
    elif section is not None and args.base is None:  # a stock directory (an imported MoE exported with its
        args.base = section.get("base_model")  # own routing) needs no --base
        if not args.base:
            raise ValueError(f"--base is needed: {Path(args.model) / 'config.json'} records no dynmoe.base_model")


def check_batches(args: argparse.Namespace) -> None:
    against_native = args.native is not None or args.build is not None
    if args.batch is None:
        args.batch = NATIVE_BATCHES if against_native else [1]
    if min(args.batch) < 1:
        raise ValueError(f"--batch ({' '.join(map(str, args.batch))}) must be >= 1")
    if not against_native and len(args.batch) > 1:
        raise ValueError(f"--batch ({' '.join(map(str, args.batch))}): one value without --native or --build")


def check_build(args: argparse.Namespace) -> None:
    """--build makes the models it times: no --model, --native or --base; a budget the model can hold."""
    from .decode_pair import FULL, TINY, check_target

    for name in ("model", "native", "base"):
        given = getattr(args, name)
        if given is not None:
            raise ValueError(f"--{name} ({given!r}) and --build ({args.build!r}): --build makes the models")
    if args.seed < 0:
        raise ValueError(f"--seed ({args.seed}) must be >= 0")
    check_target(TINY if args.tiny else FULL, args.target_k)


def read_config(directory: str, option: str) -> Dict:
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--{option} ({directory!r}) has no config.json: expected an exported directory")
    return json.loads(config_file.read_text())


def check_native(args: argparse.Namespace, exported: bool) -> None:
    """--model a DynMoE export, --native a stock directory whose config gives its top-k, no --base."""
    if args.base is not None:
        raise ValueError(f"--base ({args.base!r}) and --native ({args.native!r}): give one")
    if not exported:
        raise ValueError(f"--model ({args.model!r}) is no DynMoE export (config.json has no dynmoe section)")
    native = read_config(args.native, "native")
    if "dynmoe" in native:
        raise ValueError(f"--native ({args.native!r}) is a DynMoE export; expected the model's stock directory")
    if not isinstance(native.get("num_experts_per_tok"), int):
        raise ValueError(f"--native ({args.native!r}): config.json gives no num_experts_per_tok (its top-k)")


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


def generate(model: nn.Module, prompt_BL: torch.Tensor, new_tokens: int) -> object:
    """Greedy generation of exactly ``new_tokens`` with the KV cache."""
    return model.generate(  # type: ignore[operator]
        prompt_BL, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0
    )


def generation_times(model: nn.Module, prompt_BL: torch.Tensor, new_tokens: int) -> Dict[str, float]:
    """(prefill seconds, seconds per cached decode step) of one run."""
    with torch.no_grad():
        prefill_s = timed(lambda: generate(model, prompt_BL, 1))
        full_s = timed(lambda: generate(model, prompt_BL, new_tokens))
    return {"prefill_s": prefill_s, "per_token_s": (full_s - prefill_s) / (new_tokens - 1)}


class DecodeK:
    """Counts the experts the export's routers choose (``<block>.mlp.moe.router``, the remote code's state-dict
    layout) in the decode steps: each router's first call of a generation is the prefill and is left out."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.routers = [m for name, m in model.named_modules() if name.endswith("moe.router")]
        if not self.routers:
            raise ValueError(f"{type(model).__name__}: no MoE routers (<block>.mlp.moe.router) to count k in")
        self.calls: Dict[int, int] = {}
        self.chosen, self.tokens = 0, 0

    def hook(self, router: nn.Module, inputs: object, output: Tuple[torch.Tensor, torch.Tensor]) -> None:
        self.calls[id(router)] = self.calls.get(id(router), 0) + 1
        if self.calls[id(router)] > 1:
            mask_TE = output[0]
            self.chosen += int(mask_TE.sum())
            self.tokens += mask_TE.shape[0]

    def mean_k(self, prompt_BL: torch.Tensor, new_tokens: int) -> float:
        """Mean experts per token and MoE layer over the decode steps of one generation."""
        handles = [router.register_forward_hook(self.hook) for router in self.routers]
        try:
            with torch.no_grad():
                generate(self.model, prompt_BL, new_tokens)
        finally:
            for handle in handles:
                handle.remove()
        return self.chosen / self.tokens


def against_native(runs: Dict[str, List[Dict[str, float]]], mean_k: float, native_k: int) -> Dict:
    """One batch's comparison: the medians, k, the FLOPs ratio k / native k (the converted experts are the
    native's, so expert FLOPs per token follow k), export / native decode time and that over the target."""
    out = summarize(runs)
    flops_ratio = mean_k / native_k
    time_ratio = out["cases"]["export"]["per_token_ms_median"] / out["cases"]["native"]["per_token_ms_median"]
    target = flops_ratio + TARGET_SLACK
    return {
        **out,
        "mean_k": round(mean_k, 4),
        "flops_ratio": round(flops_ratio, 4),
        "time_ratio": round(time_ratio, 4),
        "target_ratio": round(target, 4),
        "time_over_target": round(time_ratio / target, 4),
        "meets_target": time_ratio <= target,
    }


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


def timed_runs(
    models: Dict[str, nn.Module], prompt_BL: torch.Tensor, new_tokens: int, repeats: int
) -> Dict[str, List[Dict[str, float]]]:
    """``repeats`` runs of every model, alternating, after one warm-up each."""
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in models}
    for model in models.values():  # warm-up: first calls pay for allocations and lazy imports
        generation_times(model, prompt_BL, 2)
    for _ in range(repeats):
        for name, model in models.items():
            runs[name].append(generation_times(model, prompt_BL, new_tokens))
    return runs


def random_prompt(models: Dict[str, nn.Module], batch: int, length: int) -> torch.Tensor:
    vocab = min(vocab_size(model) for model in models.values())
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def native_comparison(native: str, other: str, args: argparse.Namespace) -> Dict:
    """Per batch: ``other`` (a DynMoE export, or a stock view of the native at another top-k) against the native
    export, with its decode k (see against_native)."""
    models = {"native": load_export(native), "export": load_export(other)}
    native_k = int(cast("PreTrainedModel", models["native"]).config.num_experts_per_tok)
    batches = {}
    for batch in args.batch:
        prompt_BL = random_prompt(models, batch, args.prompt_tokens)
        runs = timed_runs(models, prompt_BL, args.new_tokens, args.repeats)
        batches[str(batch)] = against_native(runs, decode_k(models["export"], prompt_BL, args.new_tokens), native_k)
    dtype = next(models["export"].parameters()).dtype
    # transformers' choice for the native model's experts ('grouped_mm' where its kernel runs, else 'eager')
    native_experts = str(getattr(cast("PreTrainedModel", models["native"]).config, "_experts_implementation", None))
    return {
        "native": native,
        "dtype": str(dtype),
        "native_k": native_k,
        "native_experts_implementation": native_experts,
        "batches": batches,
    }


def decode_k(model: nn.Module, prompt_BL: torch.Tensor, new_tokens: int) -> float:
    """A DynMoE export's mean k over the decode steps (DecodeK); a stock model's own top-k."""
    config = cast("PreTrainedModel", model).config
    if getattr(config, "dynmoe", None) is None:
        return float(config.num_experts_per_tok)
    return DecodeK(model).mean_k(prompt_BL, new_tokens)


def built_comparison(args: argparse.Namespace) -> Dict:
    """--build: the pair built (or reused) in DIR, the export against the native and, as the sanity line, the
    native top-k/2 view against the native (can any router meet the target at this size?)."""
    from .decode_pair import FULL, TINY, build_pair

    with contextlib.redirect_stdout(sys.stderr):  # the conversion run's messages: stdout is the one JSON line
        built = build_pair(Path(args.build), TINY if args.tiny else FULL, args.target_k, args.seed)
    built = {key: value for key, value in built.items() if key != "settings"}
    export = native_comparison(built["native"], built["export"], args)
    sanity = native_comparison(built["native"], built["view"], args)
    sanity_line = {"view": built["view"], "batches": sanity["batches"]}
    return {**export, "model": built["export"], "built": built, "sanity": sanity_line}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dynmoe_dist.bench generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an exported directory (python -m dynmoe_dist.export)")
    parser.add_argument("--base", default=None, help="the dense base model (default: the export's dynmoe.base_model)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--native", default=None, help="the native export of the same MoE (its stock directory)")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=None, help="with --native or --build: several (default 1 16)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--build", default=None, help="build the native, its top-k/2 view and a top-any export here")
    parser.add_argument("--tiny", action="store_true", help="with --build: a tiny pair (tests)")
    parser.add_argument("--target-k", type=float, default=0.0, help="with --build: the budget (0: the native k / 2)")
    parser.add_argument("--seed", type=int, default=0, help="with --build: the stock model's init (default 0)")
    args = parser.parse_args(argv)
    try:
        check(args)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    torch.set_num_threads(args.threads)
    common = {"benchmark": "generate", "model": args.model, "prompt_tokens": args.prompt_tokens}
    common.update(new_tokens=args.new_tokens, repeats=args.repeats)
    if args.build is not None:
        result = {**common, **built_comparison(args)}
    elif args.native is not None:
        result = {**common, **native_comparison(args.native, args.model, args)}
    else:
        result = {**common, **base_comparison(args)}
    print(json.dumps({**result, "machine": machine_info(args.threads)}))


def base_comparison(args: argparse.Namespace) -> Dict:
    """The export against the base it started from (when there is one), at one batch."""
    moe = load_export(args.model)
    dtype = next(moe.parameters()).dtype
    models = {"moe": moe}
    if args.base is not None:  # "dense": the base the export started from (for an imported MoE, an MoE too)
        models = {"dense": load_model(args.base, "causal-lm", field="--base").to(dtype).eval(), "moe": moe}
    prompt_BL = random_prompt(models, args.batch[0], args.prompt_tokens)
    runs = timed_runs(models, prompt_BL, args.new_tokens, args.repeats)
    return {"base": args.base, "dtype": str(dtype), "batch": args.batch[0], **summarize(runs)}


if __name__ == "__main__":
    main()
