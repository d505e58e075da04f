"""bench memory: the comparison against its targets (hand-worked), and one tiny real run (slow)."""

import json
import subprocess
import sys

import pytest

from dynmoe_dist.bench.memory import compare


def _case(world, sharding, dense_state, step_s):
    return {"world": world, "dense_sharding": sharding, "dense_state_mib": dense_state, "step_s_median": step_s}


def test_comparison_against_the_targets():
    cases = [
        _case(2, "replicate", 400.0, 2.0),
        _case(2, "fsdp", 210.0, 2.4),  # 0.525 x 2 = 1.05, 1.2x
        _case(4, "replicate", 400.0, 2.0),
        _case(4, "fsdp", 120.0, 2.6),
    ]  # 0.3 x 4 = 1.2, 1.3x
    two, four = compare(cases)
    assert (two["dense_state_x_world"], two["step_time_fsdp_over_replicate"]) == (1.05, 1.2)
    assert two["meets_state_target"] and two["meets_time_target"]
    assert (four["dense_state_x_world"], four["step_time_fsdp_over_replicate"]) == (1.2, 1.3)
    assert not four["meets_state_target"] and not four["meets_time_target"]


@pytest.mark.slow
def test_tiny_memory_run_shards_the_dense_state():
    done = subprocess.run(
        [sys.executable, "-m", "dynmoe_dist.bench", "memory", "--worlds", "2", "--num-layers", "2", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    (row,) = result["comparison"]
    assert row["meets_state_target"], row
