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


def test_a_workers_mistake_becomes_the_drivers_one_line(tmp_path, monkeypatch, capsys):
    """A ValueError in a worker (here: recorded as train_worker records it) ends the job with one line and
    exit status 2 from the driver, rank 0's line first; an earlier attempt's lines are cleared first."""
    from dynmoe_dist.cluster import submit
    from dynmoe_dist.cluster.worker import clear_worker_errors, record_worker_error, worker_errors

    out_dir = tmp_path / "store" / "run"
    record_worker_error(str(out_dir), 1, ValueError("from rank 1"))
    record_worker_error(str(out_dir), 0, ValueError("task.path x:1: no key 'text'\n(task.text_field)"))
    assert worker_errors(str(out_dir)) == {
        0: "dynmoe-train: error: task.path x:1: no key 'text' (task.text_field)",
        1: "dynmoe-train: error: from rank 1",
    }
    monkeypatch.setattr(submit, "import_ray", lambda module="ray": None)
    monkeypatch.setattr(submit, "launch", lambda config, args: {})  # the job ran; the workers left their lines
    argv = ["--num-workers", "2", "--storage-path", str(tmp_path / "store"), "--name", "run"]
    assert submit.main(argv) == 2
    assert capsys.readouterr().err == "dynmoe-train: error: task.path x:1: no key 'text' (task.text_field)\n"
    clear_worker_errors(str(out_dir))
    assert worker_errors(str(out_dir)) == {}


def test_submit_check_needs_no_ray_and_prints_one_line(monkeypatch, capsys):
    from dynmoe_dist.cluster import submit

    def no_ray(module="ray"):
        raise AssertionError("--check must not import Ray")

    monkeypatch.setattr(submit, "import_ray", no_ray)
    assert submit.main(["--check", "--num-workers", "2", "--set", "parallel.ep_size=2"]) == 0
    assert submit.main(["--check", "--num-workers", "2", "--set", "parallel.ep_size=3"]) == 2
    assert capsys.readouterr().err == "dynmoe-train: error: parallel.ep_size (3) does not divide the world size (2)\n"
