"""Worker-side helpers of the Ray entry point that need no cluster: the GPU index handed to init_groups,
and the per-rank start records the run summary counts restarts from."""

import os
from types import SimpleNamespace

import torch
from dynmoe_dist.cluster.worker import record_worker_start, use_ray_gpu, worker_starts


def _fake_ray(gpu_ids, device):
    return SimpleNamespace(
        get_gpu_ids=lambda: gpu_ids, train=SimpleNamespace(torch=SimpleNamespace(get_device=lambda: device))
    )


def test_gpu_worker_takes_rays_device_index(monkeypatch):
    # node GPUs 2,3 shared by two workers: this worker (local rank 0) was given GPU 3 = cuda:1
    monkeypatch.setenv("LOCAL_RANK", "0")
    use_ray_gpu(_fake_ray([3], torch.device("cuda", 1)))
    assert os.environ["LOCAL_RANK"] == "1"


def test_cpu_worker_keeps_its_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    use_ray_gpu(_fake_ray([], None))
    assert os.environ["LOCAL_RANK"] == "1"


def test_worker_starts_count_every_start_of_every_rank(tmp_path):
    for rank, node in ((0, "10.0.0.1"), (1, "10.0.0.2"), (1, "10.0.0.3"), (0, "10.0.0.1")):
        record_worker_start(str(tmp_path), rank, 2, node)
    starts = worker_starts(str(tmp_path))
    assert list(starts) == [0, 1] and [len(s) for s in starts.values()] == [2, 2]
    assert starts[1][-1]["node_ip"] == "10.0.0.3" and starts[0][0]["world_size"] == 2
