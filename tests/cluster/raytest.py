"""Helpers of the Ray tests: local Ray nodes (stopped by session, never with `ray stop`), `ray job submit`
with a deadline, the torchrun reference run, metrics.jsonl readers. Every address is 127.0.0.1, or one
inside network namespaces the multi-node test creates itself."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from dynmoe_dist.cluster.local import (
    SESSION_FILE,
    alive,
    head_args,
    local_env,
    ray_executable,
    read_sessions,
    session_processes,
    start_node,
    stop_sessions,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = "launcher/configs/demo.toml"  # relative to the job's working dir (the uploaded checkout)
# The demo config over 3 epochs: three adaptive events, with room to kill the actor between them.
# moe.preset 'paper': these tests were built on its event pattern (an add or removal at every window, see
# test_ray_job's versions). Under the default two losses only a handful of tokens per window select no
# expert, so a window may change nothing and the pattern would test the data, not the coordination.
SETTINGS = [
    "train.epochs=3",
    "moe.preset='paper'",
    "output.tensorboard=false",
    "output.report=false",
    "output.progress=false",
]
JOB_TIMEOUT_S = 240


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RayNodes:
    """Ray nodes started by a test: the head's addresses and the session file naming their processes."""

    temp_dir: Path
    node_ip: str
    port: int
    dashboard_port: int
    prefix: Sequence[str] = ()
    """Command prefix reaching the head (e.g. `ip netns exec NS`)."""
    env: Dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.node_ip}:{self.dashboard_port}"

    @property
    def session_file(self) -> Path:
        return self.temp_dir / SESSION_FILE

    def stop(self) -> None:
        """End every process of our nodes; fail if any survived."""
        sessions = read_sessions(self.session_file)
        stop_sessions(sessions, grace_s=5.0)
        left = alive(session_processes(sessions))  # zombies are gone already, only unreaped
        assert not left, f"Ray processes left running: {sorted(left)}"


def start_head(
    node_ip: str = "127.0.0.1",
    num_cpus: int = 2,
    prefix: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    port: int = 0,
    dashboard_port: int = 0,
) -> RayNodes:
    """A head node; the caller must call .stop(). One retry on fresh ports: `ray start` picks further ports
    of its own, and on a busy machine one of them (or ours, between free_port and its use) can be taken."""
    try:
        return _start_head_once(node_ip, num_cpus, prefix, env, port, dashboard_port)
    except RuntimeError as err:
        print(f"ray start failed once, retrying on fresh ports:\n{err}", file=sys.stderr, flush=True)
        return _start_head_once(node_ip, num_cpus, prefix, env, port, dashboard_port)


def _start_head_once(node_ip, num_cpus, prefix, env, port, dashboard_port) -> RayNodes:
    temp_dir = Path(tempfile.mkdtemp(prefix="dmray-", dir="/tmp"))  # short: Ray's socket paths are limited
    nodes = RayNodes(
        temp_dir,
        node_ip,
        port or free_port(),
        dashboard_port or free_port(),
        tuple(prefix),
        env if env is not None else local_env(),
    )
    try:
        start_node(
            head_args(node_ip, nodes.port, nodes.dashboard_port, num_cpus, str(temp_dir)),
            nodes.session_file,
            nodes.env,
            prefix=nodes.prefix,
        )
    except BaseException:
        nodes.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return nodes


@dataclass
class JobResult:
    succeeded: bool
    output: str
    wall_s: float
    out_dir: Path

    def summary(self) -> Dict:
        return json.loads((self.out_dir / "ray_summary.json").read_text())

    def records(self, kind: str) -> List[Dict]:
        return read_records(self.out_dir, kind)


def submit_job(
    nodes: RayNodes,
    storage: Path,
    name: str,
    settings: Sequence[str],
    num_workers: int = 2,
    on_poll: Optional[Callable[[Path], None]] = None,
    timeout_s: float = JOB_TIMEOUT_S,
    config: str = DEMO,
) -> JobResult:
    """`ray job submit` (blocking, logs tailed) of a run file (the demo config unless told: a path relative to
    the uploaded checkout, or an absolute one on this machine); on_poll(out_dir) runs while it waits."""
    submission = f"dynmoe-test-{name}-{uuid.uuid4().hex[:8]}"
    entry = [
        sys.executable,
        "-m",
        "dynmoe_dist.cluster.submit",
        "--config",
        config,
        "--num-workers",
        str(num_workers),
        "--storage-path",
        str(storage),
        "--name",
        name,
    ]
    for setting in settings:
        entry += ["--set", setting]
    cmd = [
        *nodes.prefix,
        ray_executable(),
        "job",
        "submit",
        "--address",
        nodes.url,
        "--submission-id",
        submission,
        "--working-dir",
        str(ROOT),
        "--runtime-env",
        str(ROOT / "cluster/runtime_env.yaml"),
        "--",
        *entry,
    ]
    log = storage / f"{name}.job.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=nodes.env)
        try:
            wait_job(proc, storage / name, on_poll, started + timeout_s)
        except BaseException:
            subprocess.run(
                [*nodes.prefix, ray_executable(), "job", "stop", "--address", nodes.url, submission],
                env=nodes.env,
                timeout=60,
                capture_output=True,
            )
            proc.kill()
            proc.wait(timeout=30)
            raise
    return JobResult(proc.returncode == 0, log.read_text(), time.monotonic() - started, storage / name)


def wait_job(proc: subprocess.Popen, out_dir: Path, on_poll, deadline: float) -> None:
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ray job for {out_dir} still running at its deadline")
        if on_poll is not None:
            on_poll(out_dir)
        time.sleep(0.2)


def read_records(out_dir: Path, kind: str) -> List[Dict]:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["kind"] == kind]


def last_losses(out_dir: Path) -> Dict[int, float]:
    """step -> loss; a resumed run logs some steps twice: the last attempt's value counts."""
    return {r["step"]: r["loss"] for r in read_records(out_dir, "step")}


def plans_of(out_dir: Path) -> List[Dict]:
    """The event records without who planned them: equal lists mean the same plans were applied."""
    return [{k: v for k, v in r.items() if k != "planned_by"} for r in read_records(out_dir, "event")]


def torchrun(out_dir: Path, settings: Sequence[str], nproc: int = 2, timeout_s: float = 240) -> None:
    """The same config on `nproc` torchrun ranks (collective coordinator): the reference of the Ray runs."""
    env = dict(os.environ, PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    cmd = ["sh", "launcher/torchrun.sh", str(nproc), "--config", DEMO, "--out-dir", str(out_dir)]
    for setting in settings:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_losses_equal(out_dir: Path, reference: Path, rel: float = 1e-6) -> None:
    got, want = last_losses(out_dir), last_losses(reference)
    assert sorted(got) == sorted(want) and want, (sorted(got)[:5], sorted(want)[:5])
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rel, f"largest relative loss difference {worst:.3g} > {rel:g}"


def local_submit(python: str, storage: Path, name: str, timeout_s: float = 300, progress: bool = False):
    """launcher/ray_submit.sh --local with the demo config for 30 steps, as the README gives it: a
    temporary head on 127.0.0.1, the job, then only that head's processes stopped. Returns the finished
    process and the job's ray_summary.json (the caller asserts on the return code first)."""
    env = {**os.environ, "PYTHON": python, "RAY_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port())}
    cmd = [
        "sh",
        "launcher/ray_submit.sh",
        "--local",
        "--config",
        DEMO,
        "--num-workers",
        "2",
        "--storage-path",
        str(storage),
        "--name",
        name,
        "--set",
        "train.max_steps=30",
        "--set",
        f"output.progress={str(progress).lower()}",
        "--set",
        "output.report=false",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done, json.loads((storage / name / "ray_summary.json").read_text())
