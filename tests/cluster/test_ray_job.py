"""`ray job submit` of the demo config (3 epochs) on a local Ray head (127.0.0.1, 2 CPUs), against torchrun:

- a 2-worker gloo run finishes; its adaptive events were planned by the Ray actor, and its per-step losses
  and its plans equal those of 2 torchrun ranks (collective coordinator);
- the plan actor dies twice during a run (an injected crash while it holds half of window 1, then a SIGKILL
  from outside after window 1): Ray restarts it, the workers re-send, plans and losses are unchanged;
- training worker 1 dies after step 28: Ray Train restarts the group, which resumes from the step-20
  checkpoint (asking again for plan version 1, served from the actor's cache) and finishes with the same
  losses as the uninterrupted reference.
"""

import json
import os
import signal
import urllib.parse
import urllib.request

import pytest
from raytest import SETTINGS, assert_losses_equal, plans_of, read_records, submit_job

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]
STEPS = 120  # 3 epochs of 40 steps; events after steps 26, 66 and 106


def test_ray_job_matches_torchrun(ray_head, reference_run, tmp_path):
    job = submit_job(ray_head, tmp_path, "plain", SETTINGS)
    assert job.succeeded, job.output[-4000:]
    summary = job.summary()
    assert summary["steps"] == STEPS and summary["planned_by"] == ["ray"]
    events = job.records("event")
    assert [e["version"] for e in events] == [1, 1, 2, 2, 3, 3]  # two MoE layers per event
    assert all(e["planned_by"] == "ray" for e in events)
    assert plans_of(job.out_dir) == plans_of(reference_run)
    assert_losses_equal(job.out_dir, reference_run)
    assert summary["coordinator_restarts"] == 0 and summary["worker_group_starts"] == 1


class ActorKiller:
    """on_poll hook: once window 1 has been planned, SIGKILL the plan actor's process (found by the state API)."""

    def __init__(self, dashboard_url: str):
        self.url = dashboard_url
        self.killed_pid = None
        self.restarts_seen = None

    def __call__(self, out_dir) -> None:
        if self.killed_pid is not None or not any(e["version"] == 1 for e in read_records(out_dir, "event")):
            return
        actor = self.alive_plan_actor()
        self.restarts_seen = int(actor["num_restarts"])
        self.killed_pid = int(actor["pid"])
        os.kill(self.killed_pid, signal.SIGKILL)  # a process of our own local cluster

    def alive_plan_actor(self):
        query = urllib.parse.urlencode(
            [
                ("detail", "1"),
                ("filter_keys", "class_name"),
                ("filter_predicates", "="),
                ("filter_values", "PlanActor"),
                ("filter_keys", "state"),
                ("filter_predicates", "="),
                ("filter_values", "ALIVE"),
            ]
        )
        with urllib.request.urlopen(f"{self.url}/api/v0/actors?{query}", timeout=10) as reply:
            actors = json.load(reply)["data"]["result"]["result"]
        assert len(actors) == 1, actors
        return actors[0]


@pytest.mark.slow  # about 50 s
def test_killed_coordinator_restarts_with_the_same_plans(ray_head, reference_run, tmp_path):
    killer = ActorKiller(ray_head.url)
    job = submit_job(
        ray_head, tmp_path, "coordinator-kill", SETTINGS + ["fault.coordinator_crash_version=1"], on_poll=killer
    )
    assert job.succeeded, job.output[-4000:]
    assert "injected crash with version 1 half received" in job.output
    assert "re-sending statistics for plan version 1" in job.output  # the lost half came back from its rank
    assert killer.restarts_seen == 1 and killer.killed_pid is not None
    summary = job.summary()
    assert summary["coordinator_restarts"] == 2 and summary["planned_by"] == ["ray"]
    assert plans_of(job.out_dir) == plans_of(reference_run)
    assert_losses_equal(job.out_dir, reference_run)


@pytest.mark.slow  # about 60 s
def test_killed_worker_group_restarts_from_the_last_checkpoint(ray_head, reference_run, tmp_path):
    marker = tmp_path / "worker-crashed"
    faults = [
        "fault.crash_at_step=28",
        "fault.crash_rank=1",
        f"fault.crash_once_file='{marker}'",
        "output.checkpoint_every=10",
    ]
    job = submit_job(ray_head, tmp_path, "worker-kill", SETTINGS + faults)
    assert job.succeeded, job.output[-4000:]
    assert marker.read_text().startswith("crashed at step 28")
    summary = job.summary()
    assert summary["worker_group_starts"] == 2 and summary["steps"] == STEPS
    steps = [r["step"] for r in job.records("step")]
    assert steps[:28] == list(range(1, 29)) and steps[28:] == list(range(21, STEPS + 1))  # resumed at 20
    plans = plans_of(job.out_dir)
    assert plans[:2] == plans[2:4]  # version 1 applied again after the resume: the cached plan
    assert plans[2:] == plans_of(reference_run)
    assert_losses_equal(job.out_dir, reference_run)
