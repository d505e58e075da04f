"""Stopping local Ray nodes ends exactly the processes of their sessions (never `ray stop`, which kills
every Ray process of the machine). Plain processes stand in for Ray's: a session leader, an orphaned child
that keeps the session, and a child in a process group of its own (as Ray's workers are)."""

import os
import signal
import subprocess
import sys
import time

from dynmoe_dist.cluster.local import alive, session_processes, stop_sessions

PGID_CHANGER = "import os, time; os.setpgid(0, 0); time.sleep(300)"


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_stop_sessions_ends_the_session_and_nothing_else():
    script = f"sleep 300 & {sys.executable} -c '{PGID_CHANGER}' & sleep 300"
    leader = subprocess.Popen(["sh", "-c", script], start_new_session=True, stderr=subprocess.DEVNULL)
    outsider = subprocess.Popen(["sleep", "300"])  # our own session: must survive
    try:
        _wait_for(lambda: len(session_processes([leader.pid])) == 4)  # sh, 2 sleeps, python
        members = session_processes([leader.pid])
        assert outsider.pid not in members and os.getpid() not in members
        assert stop_sessions([leader.pid], grace_s=2.0) == 4
        leader.wait(timeout=10)
        _wait_for(lambda: not alive(members))
        assert outsider.poll() is None
    finally:
        stop_sessions([leader.pid], grace_s=0.5)
        for proc in (leader, outsider):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
