"""Start Ray nodes for tests and ``launcher/ray_submit.sh --local``, and stop exactly those nodes.

``ray stop`` kills every Ray process on the machine, other people's clusters included. Here each node is
started by ``ray start`` in a session of its own; Ray's daemons and workers keep that session id (workers
only change their process group), so stopping a node means ending the processes of that one session,
plus any of their descendants, by pid. Nothing here imports Ray.

    python -m dynmoe_dist.cluster.local start --temp-dir /tmp/ray-mine     # head on 127.0.0.1
    python -m dynmoe_dist.cluster.local stop --temp-dir /tmp/ray-mine
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

SESSION_FILE = "dynmoe_session_ids"


def ray_executable() -> str:
    """The `ray` script next to this Python (the same environment), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise FileNotFoundError("no `ray` command found: pip install -e '.[ray]' in the checkout")
    return found


def local_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for a node on 127.0.0.1: Ray keeps the loopback address instead of the outward one."""
    env = dict(os.environ if base is None else base)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    return env


def head_args(node_ip: str, port: int, dashboard_port: int, num_cpus: int, temp_dir: str) -> List[str]:
    return [
        "--head",
        f"--node-ip-address={node_ip}",
        f"--port={port}",
        f"--dashboard-host={node_ip}",
        f"--dashboard-port={dashboard_port}",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]


def start_node(
    args: Sequence[str], session_file: Path, env: Dict[str, str], prefix: Sequence[str] = (), timeout_s: float = 120.0
) -> int:
    """Run `ray start ARGS` (after PREFIX, e.g. `ip netns exec NS`) in a new session; returns its session id.

    The id is appended to session_file before waiting, so a caller can always stop what was started."""
    proc = subprocess.Popen(
        [*prefix, ray_executable(), "start", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    session_file.parent.mkdir(parents=True, exist_ok=True)
    with open(session_file, "a", encoding="utf-8") as file:
        file.write(f"{proc.pid}\n")
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_sessions([proc.pid])
        raise RuntimeError(f"`ray start {' '.join(args)}` did not finish within {timeout_s:g}s") from None
    if proc.returncode != 0:
        stop_sessions([proc.pid])
        raise RuntimeError(f"`ray start {' '.join(args)}` failed (exit {proc.returncode}):\n{output}")
    return proc.pid


# -- stopping by session --------------------------------------------------------------------------------


def process_table() -> Dict[int, tuple]:
    """pid -> (ppid, session id) for every process we can read."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        table[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return table


def session_processes(session_ids: Sequence[int]) -> Set[int]:
    """Processes of the given sessions and all their descendants, never this process or its ancestors."""
    table = process_table()
    found = {pid for pid, (_, sid) in table.items() if sid in set(session_ids)}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        found |= children
        grew = bool(children)
    return found - ancestors_of_self(table)


def ancestors_of_self(table: Dict[int, tuple]) -> Set[int]:
    chain, pid = set(), os.getpid()
    while pid in table and pid not in chain:
        chain.add(pid)
        pid = table[pid][0]
    return chain


def signal_all(pids: Set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_sessions(session_ids: Sequence[int], grace_s: float = 10.0) -> int:
    """SIGTERM the sessions' processes, SIGKILL what is left after grace_s; returns how many there were."""
    pids = session_processes(session_ids)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.2)
    signal_all(alive(pids), signal.SIGKILL)
    # A forked child can appear between the two looks: take one more pass over the sessions.
    signal_all(session_processes(session_ids), signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(session_processes(session_ids)):
        time.sleep(0.1)
    return len(pids)


def alive(pids: Set[int]) -> Set[int]:
    """Those still running (zombies waiting for their parent to reap them count as gone)."""
    running = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            running.add(pid)
    return running


def read_sessions(session_file: Path) -> List[int]:
    if not session_file.exists():
        return []
    return [int(line) for line in session_file.read_text().split() if line.strip()]


# -- command line ----------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynmoe_dist.cluster.local", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--temp-dir", required=True, help="Ray's temp dir for this head (also holds the session ids)")
    p.add_argument("--port", type=int, default=6380)
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args(argv)
    session_file = Path(args.temp_dir) / SESSION_FILE
    if args.action == "start":
        start_node(
            head_args("127.0.0.1", args.port, args.dashboard_port, args.num_cpus, args.temp_dir),
            session_file,
            local_env(),
        )
        print(f"Ray head on 127.0.0.1:{args.port}, dashboard http://127.0.0.1:{args.dashboard_port}")
        return 0
    count = stop_sessions(read_sessions(session_file))
    session_file.unlink(missing_ok=True)
    print(f"stopped {count} Ray processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
