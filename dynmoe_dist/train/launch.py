"""`python -m dynmoe_dist.train.launch NPROC [dynmoe-train options]`: one training job on NPROC local
ranks (torchrun --standalone, gloo on CPU, nccl on GPUs), what launcher/torchrun.sh runs. Extra torchrun
flags (e.g. --max-restarts 3) come from the TORCHRUN_ARGS environment variable.

The config is checked once, here, before any rank starts, by the loader every rank uses (load_config +
prepare_run, with WORLD_SIZE = NPROC so that the world-size checks run): a mistake is one line
`dynmoe-train: error: ...` and exit status 2, and no rank starts. A mistake that only a running rank can
see (a corpus without the text column, a corrupt checkpoint) goes from each rank into a file in a
directory this launcher names (DYNMOE_ERROR_DIR) instead of its stderr, and the launcher prints one of
them, rank 0's first: again one line and exit status 2, without torchrun's ChildFailedError report. A rank
that crashes any other way prints its own traceback; the launcher adds a line naming it and exits 1.

SIGINT or SIGTERM (Ctrl-C, a preempted job) is forwarded to every rank: each finishes its step, the run
writes a checkpoint, and the launcher prints one line (the step, the checkpoint, the command that
resumes it) and exits 130 / 143. A second one kills the ranks at once (parallel/elastic.py).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from ..config import RunConfig
from ..parallel.elastic import StopForwarding, run_local_workers
from . import cli
from .checkpoint import complete_checkpoints
from .control import stop_exit_status
from .printed_config import printed_config
from .startup import ConfigWarning, prepare_run

USAGE = "usage: python -m dynmoe_dist.train.launch NPROC [dynmoe-train options]  (see dynmoe-train --help)"
CRASHED = 1  # torchrun's own exit status for a failed worker
COMMAND_ENV = "DYNMOE_LAUNCH_COMMAND"  # how the user started this launcher (launcher/torchrun.sh sets it)
LAUNCH_COMMAND = "python -m dynmoe_dist.train.launch"


def parse_nproc(text: Optional[str]) -> int:
    if text is None or not text.isdigit() or int(text) < 1:
        raise ValueError(f"NPROC ({text!r}) must be a positive number of local ranks; {USAGE}")
    return int(text)


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """os.environ with these variables set (torchrun hands os.environ to the ranks it starts)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def checked_config(args, nproc: int) -> RunConfig:
    """The ranks' own loading of the config, once, as rank 0 of an NPROC world. Its warnings are left to
    rank 0 (the CLI prints them there), so that they are not printed twice."""
    with environment(WORLD_SIZE=str(nproc), RANK="0"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return prepare_run(cli.resolve(args))


def torchrun_args(nproc: int, train_args: List[str]) -> List[str]:
    extra = shlex.split(os.environ.get("TORCHRUN_ARGS", ""))
    return ["--standalone", "--nproc-per-node", str(nproc), *extra, "-m", "dynmoe_dist.train", *train_args]


def rank_errors(error_dir: Path) -> Dict[int, str]:
    """rank -> the error line that rank wrote (cli.report_error)."""
    found = {}
    for path in error_dir.glob("rank*"):
        rank = path.name[len("rank") :]
        if rank.isdigit() and path.read_text().strip():
            found[int(rank)] = path.read_text().strip()
    return dict(sorted(found.items()))


def outcome(failures: Dict[int, int], errors: Dict[int, str]) -> int:
    """Exit status of the job, with its one line on stderr: a rank's error line (rank 0's first; exit 2),
    or which rank crashed (its traceback is above; exit 1)."""
    if errors:
        print(errors[min(errors)], file=sys.stderr, flush=True)
        return cli.USAGE_ERROR
    if failures:
        rank, code = next(iter(failures.items()))  # the first to fail
        print(f"dynmoe-train: rank {rank} failed (exit status {code}); its output is above", file=sys.stderr)
        return CRASHED
    return 0


def stopped_outcome(stop: StopForwarding, failures: Dict[int, int], error_dir: Path, out_dir: str, command: str):
    """The one line of a job a signal stopped, and its exit status (130 / 143); None when the signal did
    not end the job (it finished before any rank saw it, or a rank failed on its own). The ranks wrote a
    checkpoint (rank 0 left where), or were killed: by a second signal, or by the signal itself in the
    moment torch starts one (before its own session: the terminal's Ctrl-C reaches it too)."""
    stopped = cli.read_stop(error_dir) if not stop.hard else None
    if stopped is not None and not failures:
        line = cli.stop_line({**stopped, "signal": stop.signum}, command)
    elif stop.hard or (failures and all(code < 0 for code in failures.values())):
        how = f"at once by a second {signal.Signals(stop.signum).name}" if stop.hard else "while the ranks started"
        line = killed_line(how, out_dir, command)
    else:
        return None
    print(line, file=sys.stderr, flush=True)
    return stop_exit_status(stop.signum)


def killed_line(how: str, out_dir: str, command: str) -> str:
    found = complete_checkpoints(out_dir)
    where = f"newest checkpoint: {found[-1]}; resume: {command}" if found else "no checkpoint to resume from"
    return f"dynmoe-train: stopped {how}, without a checkpoint; {where}"


def launch(nproc: int, train_args: List[str], out_dir: str) -> int:
    # torchrun sets OMP_NUM_THREADS=1 for several ranks anyway, with a 4-line warning when it was unset.
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if nproc > 1 else {}
    with tempfile.TemporaryDirectory(prefix="dynmoe-errors-") as error_dir:
        stop = StopForwarding(
            lambda: cli.rank_pids(Path(error_dir)), lambda signum: cli.announce_stop(Path(error_dir), signum)
        )
        with environment(**{cli.ERROR_DIR_ENV: error_dir}, **threads):
            failures = run_local_workers(torchrun_args(nproc, train_args), stop)
        if stop.signum:
            command = cli.resume_command(f"{os.environ.get(COMMAND_ENV, LAUNCH_COMMAND)} {nproc}", train_args)
            status = stopped_outcome(stop, failures, Path(error_dir), out_dir, command)
            if status is not None:
                return status
        return outcome(failures, rank_errors(Path(error_dir)) if failures else {})


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return checked_launch(argv)
    except KeyboardInterrupt:  # Ctrl-C while the config is checked, before any rank started: nothing to save
        print("dynmoe-train: stopped by SIGINT before training started", file=sys.stderr, flush=True)
        return stop_exit_status(signal.SIGINT)


def checked_launch(argv: Optional[List[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc_text, train_args = (argv[0], argv[1:]) if argv else (None, [])
    if nproc_text in ("-h", "--help"):
        print(USAGE)
        return 0
    args = cli.parser().parse_args(train_args)  # --help, and argparse's own errors (exit 2), happen here
    try:
        nproc = parse_nproc(nproc_text)
        config = checked_config(args, nproc)
    except ValueError as err:
        if os.environ.get("DYNMOE_TRACEBACK"):
            raise
        print(f"dynmoe-train: error: {cli.one_line(err)}", file=sys.stderr, flush=True)
        return cli.USAGE_ERROR
    if args.print_config:
        print(printed_config(config))
        return 0
    return launch(nproc, train_args, config.output.out_dir)


if __name__ == "__main__":
    sys.exit(main())
