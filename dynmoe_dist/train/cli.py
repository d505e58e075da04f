"""`dynmoe-train` / `python -m dynmoe_dist.train`: run a training job from a TOML file plus overrides.

Works as a single process, under `torchrun --nproc-per-node N`, and inside Ray Train workers.
A user mistake (a ValueError: config, data files, checkpoint) ends the command with one line
`dynmoe-train: error: ...` on stderr and exit status 2, no traceback (DYNMOE_TRACEBACK=1 shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional

from ..config import RunConfig, load_config, options_help
from .control import StopSignals, stop_exit_status
from .help import option_choices, paths_note
from .printed_config import printed_config
from .startup import ConfigWarning, prepare_run

USAGE_ERROR = 2  # the exit status argparse uses for a bad command line
# Set by train/launch.py for the ranks it starts: the directory where each rank leaves its error line
# (rank{r}), its process id (pid{r}, to which the launcher forwards SIGINT / SIGTERM) and, on rank 0,
# where a run stopped by a signal stopped (STOPPED_FILE); the launcher leaves a stop signal (STOP_FILE).
ERROR_DIR_ENV = "DYNMOE_ERROR_DIR"
STOPPED_FILE = "stopped.json"
STOP_FILE = "stop"  # the launcher's stop signal, for ranks that register after it came
SELF_COMMAND = "python -m dynmoe_dist.train"


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


# -- a run stopped by SIGINT / SIGTERM -------------------------------------------------------------
def register_rank(signals: StopSignals) -> None:
    """Under the launcher: leave this rank's process id, to which it forwards a stop signal, then take a
    stop it announced before (announce_stop)."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        Path(error_dir, f"pid{os.environ.get('RANK', '0')}").write_text(f"{os.getpid()}\n")
        announced = Path(error_dir, STOP_FILE)
        if announced.is_file() and announced.read_text().strip().isdigit():
            signals.ask(int(announced.read_text()))


def announce_stop(error_dir: Path, signum: int) -> None:
    """The launcher's stop signal, for the ranks that register after it came."""
    (error_dir / STOP_FILE).write_text(f"{signum}\n")


def rank_pids(error_dir: Path) -> List[int]:
    """The process ids the ranks registered (register_rank)."""
    return [int(path.read_text()) for path in error_dir.glob("pid*") if path.read_text().strip().isdigit()]


def resume_command(command: str, argv: List[str]) -> str:
    """The command that continues this run: its own options, any resume option replaced by --resume auto."""
    kept: List[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--resume" or (arg == "--set" and argv[i + 1 : i + 2] and argv[i + 1].startswith("output.resume=")):
            skip = True
        elif not arg.startswith(("--resume=", "--set=output.resume=")):
            kept.append(arg)
    return f"{command} {shlex.join(kept + ['--resume', 'auto'])}"


def stop_line(stopped: Dict, command: str) -> str:
    """The one line of a run stopped by a signal: after which step, its checkpoint, how to resume."""
    name = signal.Signals(stopped["signal"]).name
    head = f"dynmoe-train: stopped by {name} after step {stopped['step']}"
    checkpoint = stopped.get("checkpoint")
    if not checkpoint:
        return f"{head}; no checkpoint was written (output.final_checkpoint = false): a rerun starts at step 0"
    return f"{head}; checkpoint: {checkpoint}; resume: {command}"


def report_stop(stopped: Dict, argv: List[str]) -> int:
    """Rank 0 says where the run stopped: into the launcher's directory (it prints the line, with its
    own command), or on stderr. Exit status: 0 under the launcher (a rank that exits otherwise would
    make torchrun restart the group), else the shell's for the signal (130, 143)."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if stopped.get("rank0", True):
        if error_dir:
            Path(error_dir, STOPPED_FILE).write_text(
                json.dumps({k: stopped[k] for k in ("step", "signal", "checkpoint")})
            )
        else:
            print(stop_line(stopped, resume_command(SELF_COMMAND, argv)), file=sys.stderr, flush=True)
    return 0 if error_dir else stop_exit_status(stopped["signal"])


def read_stop(error_dir: Path) -> Optional[Dict]:
    """What rank 0 left in the launcher's directory when the run stopped on a signal (None: it did not)."""
    path = error_dir / STOPPED_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def train(args, argv: List[str]) -> int:
    # First: a stop during start-up takes effect after the first step.
    with StopSignals().installed() as signals:
        register_rank(signals)
        config = start(args)
        if args.print_config:
            print(printed_config(config))
            return 0
        from .run import run  # heavy imports only when actually training

        final = run(config, signals=signals)
    if final["kind"] == "stopped":
        return report_stop(final, argv)
    if final.get("rank0", True) and "test_accuracy" in final:
        print(summary(final, config.output.out_dir), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    return guarded(lambda: train(args, argv))


if __name__ == "__main__":
    sys.exit(main())
