"""bench checkpoint: the summary against its target (hand-worked), bad --ranks, and a tiny run on 2 ranks
whose FSDP save writes one shard file per rank and whose load restores the weights."""

import json

import pytest

from dynmoe_dist.bench import checkpoint as bench


def _rank(rank, save_peak, load_peak, save_s, load_s):
    return {
        "rank": rank,
        "full_dense_state_bytes": 200 * bench.MIB,
        "local_dense_state_bytes": 100 * bench.MIB,
        "file_bytes": 101 * bench.MIB,
        "save_peak_extra_mib": save_peak,
        "load_peak_extra_mib": load_peak,
        "save_s": save_s,
        "load_s": load_s,
        "weights_restored": True,
    }


def test_summary_takes_the_worst_rank_against_the_target():
    # 2 ranks, full dense state 200 MiB: target 1.2 / 2 * 200 + 64 = 184 MiB
    row = bench.summarize(2, [_rank(0, 30.0, 150.0, 1.5, 2.0), _rank(1, 20.0, 160.0, 1.25, 2.5)])
    assert row["target_peak_extra_mib"] == 184.0 and row["full_dense_state_mib"] == 200.0
    assert (row["max_save_peak_extra_mib"], row["max_load_peak_extra_mib"]) == (30.0, 160.0)
    assert (row["save_s"], row["load_s"]) == (1.5, 2.5)  # the slowest rank's
    assert row["meets_target"] and row["weights_restored"]
    assert row["per_rank"][1]["local_dense_state_mib"] == 100.0
    over = bench.summarize(2, [_rank(0, 30.0, 185.0, 1.0, 1.0), _rank(1, 20.0, 10.0, 1.0, 1.0)])
    assert not over["meets_target"]


@pytest.mark.parametrize("text", ["", "0,2", "two", "1,-4"])
def test_bad_ranks_are_refused_by_name(text):
    with pytest.raises(SystemExit, match=r"--ranks .* must be a comma-separated list of positive integers"):
        bench.parse_ranks(text)


@pytest.mark.slow  # two spawned ranks building a Llama: ~40 s on 2 busy cores
def test_tiny_run_shards_the_saved_state_and_restores_the_weights(tmp_path, capsys):
    out = tmp_path / "checkpoint.json"
    bench.main(["--tiny", "--ranks", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    (case,) = result["cases"]
    assert case["ranks"] == 2 and case["weights_restored"]
    full = case["full_dense_state_mib"]
    shares = [r["local_dense_state_mib"] for r in case["per_rank"]]
    assert abs(sum(shares) - full) <= 0.02 and max(shares) <= 0.6 * full  # each rank holds and writes ~1/2
    assert all(r["file_mib"] >= r["local_dense_state_mib"] - 0.01 for r in case["per_rank"])
    assert case["save_s"] > 0 and case["load_s"] > 0
