"""bench import: the summary against its target (hand-worked), the run it builds on a checkpoint (in this
process: its share is the whole checkpoint, and the value check sees a tensor that was not read), and a
tiny run on spawned ranks (slow: 2 ranks)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dynmoe_dist.bench import import_load as bench  # noqa: E402
from dynmoe_dist.bench.moe_checkpoint import write_checkpoint  # noqa: E402


def _rank(rank, peak, dense, experts, seconds, match=True):
    return {
        "rank": rank,
        "peak_mib": peak,
        "dense_mib": dense,
        "expert_mib": experts,
        "load_s": seconds,
        "build_model_s": seconds / 2,
        "checked_tensors": 16,
        "values_match": match,
    }


def test_summary_checks_each_rank_against_its_own_share_and_says_by_how_much_it_missed():
    # rank 0 holds 100 + 400 = 500 MiB: target 1.2 * 500 + 200 = 800; peak 650 meets it
    # rank 1 holds 100 + 300 = 400 MiB: target 680; peak 700 misses it by 20
    case = bench.summarize(2, [_rank(0, 650.0, 100.0, 400.0, 2.0), _rank(1, 700.0, 100.0, 300.0, 3.5)])
    first, second = case["per_rank"]
    assert (first["share_mib"], first["target_mib"], first["meets_target"]) == (500.0, 800.0, True)
    assert first["peak_over_share"] == 1.3 and first["over_target_mib"] == 0.0
    assert (second["target_mib"], second["meets_target"], second["over_target_mib"]) == (680.0, False, 20.0)
    assert not case["meets_target"] and case["missed_by_mib"] == 20.0
    assert case["load_s"] == 3.5 and case["max_peak_mib"] == 700.0  # the slowest rank, the largest peak
    assert case["build_model_s"] == 1.75 and second["build_model_s"] == 1.75
    ok = bench.summarize(1, [_rank(0, 800.0, 100.0, 400.0, 1.0, match=False)])
    assert ok["meets_target"] and ok["missed_by_mib"] == 0.0 and not ok["values_match"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    return directory, write_checkpoint(directory, bench.TINY, max_shard_bytes=64 * 1024)


def test_the_run_takes_the_checkpoints_routing_and_shards_dense_weights(tiny_checkpoint):
    config = bench.run_config(tiny_checkpoint[0])
    assert config.moe.router == "native" and config.moe.num_experts == 8
    assert config.model.moe_layers == [0, 1] and config.model.num_layers == 2
    assert config.parallel.dense_sharding == "fsdp" and config.parallel.ep_size == 0  # experts over the world


def test_one_process_holds_the_whole_checkpoint_and_the_check_catches_a_tensor_not_read(tiny_checkpoint):
    directory, described = tiny_checkpoint
    parts, build_model_s = bench.build_run(directory, bench.TINY.vocab)
    assert build_model_s > 0
    dense, experts = bench.held_bytes(parts)
    assert experts == described["expert_parameters"] * 4
    # + the rotary module's inv_freq and original_inv_freq (8 floats each at head dim 16): buffers computed
    # from the config, not in the files
    assert dense == described["dense_parameters"] * 4 + 2 * 8 * 4
    checked, match = bench.check_values(parts, directory)
    assert checked == 4 + 2 * 2 * 3 and match  # 4 dense tensors, 2 experts of 2 layers, 3 weights each
    with torch.no_grad():
        parts.experts.shards[-1].layer.experts.experts[-1].w_out.zero_()  # as if never read
    assert bench.check_values(parts, directory) == (checked, False)


@pytest.mark.slow  # two spawned ranks importing transformers on 2 busy cores: ~40 s
def test_tiny_run_on_two_ranks_splits_the_checkpoint_and_reads_the_files_values(tmp_path, capsys):
    out = tmp_path / "import.json"
    bench.main(["--tiny", "--ranks", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    (case,) = result["cases"]
    assert case["ranks"] == 2 and case["values_match"] and result["values_match"]
    total = result["checkpoint"]["total_mib"]
    shares = [r["share_mib"] for r in case["per_rank"]]
    assert abs(sum(shares) - total) < 0.05 and max(shares) < 0.6 * total  # each rank holds about half
    assert all(r["peak_mib"] > 0 and r["load_s"] > r["build_model_s"] > 0 for r in case["per_rank"])
    assert isinstance(result["meets_target"], bool)
