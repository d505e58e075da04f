"""`python -m dynmoe_dist.cluster.relay COMMAND...`: run `ray job submit ...` and pass its output through,
ending with the job's one error line when it has one.

A job whose driver or workers hit a user mistake ends with one line `dynmoe-train: error: ...` and exit
status 2 (submit.py). `ray job submit` then prints a failure banner and the job's last logs a second
time, and exits 1. Here the output stops after that line and the exit status is 2, as under torchrun.
Any other outcome passes through unchanged, with the command's own exit status.
"""

from __future__ import annotations

import subprocess
import sys
from typing import IO, Iterable, List, Optional

ERROR_PREFIX = "dynmoe-train: error: "
USAGE_ERROR = 2


def relay(lines: Iterable[str], out: IO[str]) -> Optional[str]:
    """Copy lines to out up to and including the first error line; return that line (None if there was
    none). The rest is read but not shown: after the driver's error line only Ray's failure report follows."""
    found = None
    for line in lines:
        if found is None:
            out.write(line)
            out.flush()
            if line.startswith(ERROR_PREFIX):
                found = line.strip()
    return found


def main(argv: Optional[List[str]] = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m dynmoe_dist.cluster.relay COMMAND [ARGS...]", file=sys.stderr)
        return USAGE_ERROR
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        found = relay(proc.stdout, sys.stdout)
    if found is not None and proc.returncode != 0:
        return USAGE_ERROR
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
