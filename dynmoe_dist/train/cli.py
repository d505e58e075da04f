"""`dynmoe-train` / `python -m dynmoe_dist.train`: run a training job from a TOML file plus overrides.

Works as a single process, under `torchrun --nproc-per-node N`, and inside Ray Train workers.
A user mistake (a ValueError: config, data files, checkpoint) ends the command with one line
`dynmoe-train: error: ...` on stderr and exit status 2, no traceback (DYNMOE_TRACEBACK=1 shows it).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, List, NoReturn, Optional

from ..config import RunConfig, load_config, options_help
from .help import option_choices, paths_note
from .printed_config import printed_config
from .startup import ConfigWarning, prepare_run

USAGE_ERROR = 2  # the exit status argparse uses for a bad command line
ERROR_DIR_ENV = "DYNMOE_ERROR_DIR"  # set by train/launch.py for the ranks it starts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynmoe-train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a DynMoE model (single process, torchrun, or Ray workers).",
        epilog="Every option below can be set in the TOML file (as [section] key = value) or with\n"
        "--set section.key=value. A mistake is one line 'error: ...' and exit status 2\n"
        "(DYNMOE_TRACEBACK=1 shows the traceback).\n" + paths_note() + "\n\n" + options_help(option_choices()),
    )
    p.add_argument("--config", help="TOML run file (e.g. launcher/configs/demo.toml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one option (repeatable)",
    )
    p.add_argument("--out-dir", help="shortcut for --set output.out_dir=DIR")
    p.add_argument("--resume", help="shortcut for --set output.resume=auto|PATH")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    return p


def resolve(args) -> "RunConfig":
    overrides = list(args.overrides)
    if args.out_dir:
        overrides.append(f"output.out_dir={args.out_dir!r}")
    if args.resume:
        overrides.append(f"output.resume={args.resume!r}")
    return load_config(args.config, overrides)


def summary(final: dict, out_dir: str) -> str:
    """What the end of a run prints: its final scores, its experts, and where its files are, with the
    commands a user runs next (export, for a model that can be exported)."""
    lines = [f"final (step {final['step']}, {final['wall_s']:.1f} s): {final_scores(final)}"]
    blocks = final.get("blocks") or list(range(len(final.get("num_experts") or [])))
    if final.get("num_experts"):
        counts = ", ".join(f"block {b}: {n}" for b, n in zip(blocks, final["num_experts"]))
        lines.append(f"experts per MoE block at the end: {counts}")
    lines.append(f"metrics:    {out_dir}/metrics.jsonl")
    if final.get("report"):
        lines.append(f"report:     {final['report']}")
    if final.get("checkpoint"):
        lines.append(f"checkpoint: {final['checkpoint']}")
    if final.get("export_command"):
        lines.append(f"export it:  {final['export_command']}")
    return "\n".join(lines)


def final_scores(final: dict) -> str:
    """'test accuracy 0.8006, test loss 0.4321'; a language model's perplexity first, and its accuracy is
    per token."""
    if "test_perplexity" in final:
        return (
            f"held-out perplexity {final['test_perplexity']:.2f}, test loss {final['test_loss']:.4f} per token, "
            f"next-token accuracy {final['test_accuracy']:.4f}"
        )
    return f"test accuracy {final['test_accuracy']:.4f}, test loss {final['test_loss']:.4f}"


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def one_line(err: object) -> str:
    # Some messages quote other libraries' multi-line errors (a corrupt checkpoint's torch.load error).
    return " ".join(str(err).split())


def exit_usage_error(prog: str, err: object) -> NoReturn:
    """A command's bad input: one error line naming the command on stderr, exit status 2 (argparse's)."""
    print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
    raise SystemExit(2)


def report_error(err: object) -> None:
    """The one error line: on stderr, or, under the launcher (train/launch.py), into this rank's file in
    the directory it names, from which it prints one line for the whole job."""
    line = f"dynmoe-train: error: {one_line(err)}"
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        Path(error_dir, f"rank{os.environ.get('RANK', '0')}").write_text(line + "\n")
    else:
        print(line, file=sys.stderr, flush=True)


def guarded(action: Callable[[], int]) -> int:
    """action(), with a ValueError (a user mistake) turned into one error line and exit status 2."""
    try:
        return action()
    except ValueError as err:
        if os.environ.get("DYNMOE_TRACEBACK"):
            raise
        report_error(err)
        return USAGE_ERROR


def start(args) -> RunConfig:
    """The checked, prepared config; its start-up warnings printed as one line each, on rank 0 only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        config = prepare_run(resolve(args))
    for w in caught:
        if not issubclass(w.category, ConfigWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        elif is_rank0():
            print(f"dynmoe-train: warning: {one_line(w.message)}", file=sys.stderr, flush=True)
    return config


def train(args) -> int:
    config = start(args)
    if args.print_config:
        print(printed_config(config))
        return 0
    from .run import run  # heavy imports only when actually training

    final = run(config)
    if final.get("rank0", True) and "test_accuracy" in final:
        print(summary(final, config.output.out_dir), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return guarded(lambda: train(args))


if __name__ == "__main__":
    sys.exit(main())
