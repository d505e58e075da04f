"""Multi-node on one machine: two network namespaces joined by a veth pair, a Ray head (1 CPU) in one and a
worker node (1 CPU) in the other, so the two training workers land on different nodes. Their gloo traffic
must cross the veth interface (its byte counters are read before and after), and the losses and plans must
equal the 2-rank torchrun reference. Root only (namespaces and veth pairs need it); skipped elsewhere.

The only addresses used are 10.213.77.1 and .2, which exist only inside the two namespaces created here.
"""

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest
from dynmoe_dist.cluster.local import local_env, start_node
from raytest import SETTINGS, assert_losses_equal, plans_of, start_head, submit_job

# About 80 s: slow (the default suite keeps tests/cluster/test_ray_job.py's job, the same code on one node).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
HEAD_IP, WORKER_IP = "10.213.77.1", "10.213.77.2"
IFNAME = "dmveth0"  # the same name at both ends (each in its own namespace), so one GLOO_SOCKET_IFNAME fits all


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def skip_reason():
    if os.geteuid() != 0:
        return "needs root (network namespaces and veth pairs)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"dmprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot create network namespaces here: {done.stderr.strip()}"
    ip("netns", "del", probe)
    return None


@dataclass
class Namespaces:
    head: str
    worker: str

    def exec_prefix(self, ns: str):
        return ("ip", "netns", "exec", ns)


def build_namespaces(ns: Namespaces, tag: str) -> None:
    ip("link", "add", f"dmvh{tag}", "type", "veth", "peer", "name", f"dmvw{tag}")
    for name, end, address in ((ns.head, f"dmvh{tag}", HEAD_IP), (ns.worker, f"dmvw{tag}", WORKER_IP)):
        ip("link", "set", end, "netns", name)
        ip("-n", name, "link", "set", end, "name", IFNAME)
        ip("-n", name, "addr", "add", f"{address}/24", "dev", IFNAME)
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "set", IFNAME, "up")


@pytest.fixture(scope="module")
def namespaces():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tag = str(os.getpid() % 100000)
    ns = Namespaces(f"dmhead{tag}", f"dmwork{tag}")
    created = []
    try:
        for name in (ns.head, ns.worker):
            ip("netns", "add", name)
            created.append(name)
        build_namespaces(ns, tag)
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", f"dmvh{tag}"], capture_output=True, timeout=30)  # if never moved
        for name in created:  # deleting a namespace destroys the veth end inside it (and so the pair)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def interface_bytes(ns: str) -> int:
    """Bytes sent plus received on the namespace's veth end."""
    done = subprocess.run(
        ["ip", "-n", ns, "-s", "-j", "link", "show", "dev", IFNAME],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    stats = json.loads(done.stdout)[0]["stats64"]
    return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def multinode_env():
    env = local_env()
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"  # a real multi-node cluster: nodes join over the veth
    env["GLOO_SOCKET_IFNAME"] = IFNAME  # the hostname resolves to 127.0.0.1: gloo must use the veth instead
    return env


def test_job_spans_two_nodes_across_a_network_interface(namespaces, reference_run, tmp_path):
    env = multinode_env()
    head = start_head(
        HEAD_IP, num_cpus=1, prefix=namespaces.exec_prefix(namespaces.head), env=env, port=6380, dashboard_port=8265
    )
    try:
        worker_args = [
            f"--address={HEAD_IP}:{head.port}",
            f"--node-ip-address={WORKER_IP}",
            "--num-cpus=1",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--temp-dir={head.temp_dir / 'worker-node'}",
        ]
        start_node(worker_args, head.session_file, env, prefix=namespaces.exec_prefix(namespaces.worker))
        before = interface_bytes(namespaces.head)
        job = submit_job(head, tmp_path, "two-nodes", SETTINGS)
        crossed = interface_bytes(namespaces.head) - before
    finally:
        try:
            head.stop()
        finally:
            shutil.rmtree(head.temp_dir, ignore_errors=True)
    assert job.succeeded, job.output[-4000:]
    print(f"{crossed} bytes crossed {IFNAME} during the job")
    summary = job.summary()
    assert summary["worker_nodes"] == [HEAD_IP, WORKER_IP] and summary["planned_by"] == ["ray"]
    # 120 steps of gradient all-reduce alone (62k parameters) move ~30 MB; Ray's own traffic is far less.
    assert crossed > 20_000_000, f"only {crossed} bytes crossed {IFNAME}"
    assert plans_of(job.out_dir) == plans_of(reference_run)
    assert_losses_equal(job.out_dir, reference_run)
