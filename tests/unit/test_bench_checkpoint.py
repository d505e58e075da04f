"""bench checkpoint: the summary against its targets (hand-worked), bad options, and a tiny run on 2 ranks that
evaluates, writes the experts with their Adam state and the dense shards, and restores the dense weights."""

import json

import pytest

from dynmoe_dist.bench import checkpoint as bench


def _rank(rank, share, evaluate, save, load):
    return {
        "rank": rank,
        "share_mib": share,
        "experts_mib": 0.9 * share,
        "full_dense_state_mib": 200.0,
        "expert_file_mib": 3 * share,
        "peak_extra_mib": {"evaluate": evaluate, "save": save, "load": load},
        "seconds": {"evaluate": 0.5, "save": 1.0 + rank, "load": 2.0},
        "weights_restored": True,
    }


def test_summary_holds_every_rank_to_its_own_share():
    # 2 ranks. Rank 0's share 1000 MiB: evaluate / save <= 0.1 x 1000 + 64 = 164 MiB; rank 1's 400 MiB:
    # <= 104 MiB. Load (the dense state, 200 MiB in all) <= 1.2 / 2 x 200 + 64 = 184 MiB for both.
    row = bench.summarize(2, [_rank(0, 1000.0, 10.0, 150.0, 180.0), _rank(1, 400.0, 12.0, 100.0, 20.0)])
    assert row["per_rank"][1]["target_mib"] == {"evaluate": 104.0, "save": 104.0, "load": 184.0}
    assert row["phases"]["save"]["max_peak_extra_mib"] == 150.0
    assert row["phases"]["save"]["max_peak_extra_over_share"] == 0.25  # rank 1: 100 / 400
    assert row["phases"]["save"]["seconds"] == 2.0  # the slowest rank's
    assert row["meets_targets"] and row["weights_restored"] and row["max_share_mib"] == 1000.0
    # 150 MiB is within rank 0's target, not within rank 1's
    over = bench.summarize(2, [_rank(0, 1000.0, 10.0, 150.0, 180.0), _rank(1, 400.0, 12.0, 150.0, 20.0)])
    assert not over["phases"]["save"]["meets_target"] and over["phases"]["evaluate"]["meets_target"]
    assert not over["meets_targets"]
    held_copy = bench.summarize(1, [_rank(0, 1000.0, 1000.0, 10.0, 10.0)])  # an evaluation holding the weights
    assert not held_copy["phases"]["evaluate"]["meets_target"]


@pytest.mark.parametrize("text", ["", "0,2", "two", "1,-4"])
def test_bad_ranks_are_refused_by_name(text):
    with pytest.raises(SystemExit, match=r"--ranks .* must be a comma-separated list of positive integers"):
        bench.parse_ranks(text)


def test_more_ranks_than_experts_are_refused_before_any_work():
    with pytest.raises(SystemExit, match=r"--ranks \('2,8'\) must be at most 4"):
        bench.main(["--tiny", "--ranks", "2,8"])


@pytest.mark.slow  # two spawned ranks loading an imported MoE: ~40 s on 2 busy cores
def test_tiny_run_writes_experts_and_their_adam_state_and_restores_the_dense_weights(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    bench.main(["--tiny", "--ranks", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    (case,) = result["cases"]
    assert case["ranks"] == 2 and case["weights_restored"]
    assert set(case["phases"]) == {"evaluate", "save", "load"}
    assert all(p["seconds"] > 0 and p["max_peak_extra_mib"] == p["max_peak_extra_mib"] for p in case["phases"].values())
    for rank in case["per_rank"]:  # each rank's file: the 2 of 4 experts per layer it owns, weights and 2 moments
        assert 0 < rank["experts_mib"] < rank["share_mib"] and 3 <= rank["expert_file_over_experts"] < 3.1
