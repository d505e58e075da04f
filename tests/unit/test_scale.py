"""bench scale: the alpha-beta all-to-all model (hand-computed times) and the simulation on tiny sizes."""

import json

import numpy as np
import pytest

from dynmoe_dist.bench import netmodel, scale

NET = netmodel.Network(inter_node_bytes_per_s=10.0, intra_node_bytes_per_s=100.0, gpus_per_node=2, alpha_s=1.0)


def test_two_ranks_on_one_node():
    # rank 0 sends 200 B to rank 1 (same node): 1 peer * 1 s + 200 / 100 = 3 s; the diagonal is free
    send = np.array([[999.0, 200.0], [0.0, 0.0]])
    t = netmodel.all_to_all_time(send, NET)
    assert t["time_s"] == pytest.approx(3.0)
    assert t["max_send_bytes"] == 200 and t["max_recv_bytes"] == 200 and t["mean_send_bytes"] == 100


def test_intra_and_inter_links_overlap_and_receivers_count():
    # 4 ranks, nodes {0, 1} and {2, 3}; intra 100 B/s, inter 10 B/s, alpha 1 s per peer.
    send = np.zeros((4, 4))
    send[0, 1], send[0, 2], send[0, 3], send[2, 3] = 100, 30, 50, 40
    # rank 0 sends: 3 peers + max(intra 100/100 = 1, inter (30 + 50)/10 = 8) = 11 s, the slowest side
    assert netmodel.all_to_all_time(send, NET)["time_s"] == pytest.approx(11.0)
    send[0, 3], send[1, 3] = 0, 50
    # senders: rank 0 2 + max(1, 3) = 5, rank 1 1 + 5 = 6, rank 2 1 + 0.4 = 1.4;
    # receivers: rank 3 gets 40 intra (0.4) and 50 inter (5) from 2 peers: 2 + 5 = 7 s, the slowest side
    assert netmodel.all_to_all_time(send, NET)["time_s"] == pytest.approx(7.0)


def test_send_matrix_splits_experts_over_replicas():
    # expert 0 (share 0.5) on ranks 0 and 1, expert 1 (0.5) on rank 1: rank 1 gets 0.25 + 0.5
    to = netmodel.rows_to_ranks([0.5, 0.5], [[0, 1], [1]], 2)
    assert to.tolist() == [0.25, 0.75]
    send = netmodel.send_matrix([0.5, 0.5], [[0, 1], [1]], 2, rows_per_rank=8, row_bytes=2)
    assert send.tolist() == [[4.0, 12.0], [4.0, 12.0]]


def test_bad_network_and_matrix_are_rejected():
    with pytest.raises(ValueError, match=r"alpha_s \(0"):
        netmodel.Network(alpha_s=0)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        netmodel.all_to_all_time(np.zeros((2, 3)), NET)


def test_profiles_sum_to_one_and_keep_the_shared_share():
    shares = scale.zipf_shared(16, 0.4)
    assert sum(shares) == pytest.approx(1.0) and shares[0] == 0.4 and shares[1] > shares[-1]
    recorded = scale.resample([10, 0, 30, 60], 8)
    assert len(recorded) == 8 and sum(recorded) == pytest.approx(1.0) and recorded[0] == pytest.approx(0.6)
    assert min(recorded) > 0


def test_tiny_simulation_plans_and_balances(tmp_path):
    recorded = {"source": "test", "expert_load_per_layer": [[5, 1, 30, 2]]}
    result = scale.simulate(ranks_list=(4, 16), experts_list=(8,), recorded=recorded, repeats=1, factors=(1.05,))
    json.dumps(result)  # plain JSON
    assert {c["profile"] for c in result["cases"]} == {"zipf+shared 30%", "zipf+shared 60%", "recorded layer 0"}
    for case in result["cases"]:
        assert case["ep_size"] == min(case["ranks"], 8) and case["dp_replicas"] * case["ep_size"] == case["ranks"]
        assert case["imbalance_before"] > 2 and case["imbalance_after"] <= 1.2
        replicated, initial = case["traffic_replicated"], case["traffic_initial"]
        assert replicated["all_to_all_ms"] < initial["all_to_all_ms"]
        assert replicated["max_recv_mb_per_step"] < initial["max_recv_mb_per_step"]
        assert case["plan_s"] < 5


def test_extract_recorded_sums_the_steps_after_the_last_event(tmp_path):
    lines = [
        {"kind": "step", "step": 1, "expert_load": [[9, 9]]},
        {"kind": "event", "step": 1},
        {"kind": "step", "step": 2, "expert_load": [[1, 2, 3]]},
        {"kind": "step", "step": 3, "expert_load": [[1, 0, 5]]},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    data = scale.extract_recorded(tmp_path, tmp_path / "out.json")
    assert data["expert_load_per_layer"] == [[2, 2, 8]] and data["steps"] == [2, 3]
    assert json.loads((tmp_path / "out.json").read_text()) == data


def test_mapping_option_is_checked():
    with pytest.raises(ValueError, match=r"--mapping \('ring'\)"):
        scale.ep_size_for(8, 4, "ring")
    assert scale.ep_size_for(2048, 256, "ep-le-experts") == 256 and scale.ep_size_for(64, 256, "all-ranks") == 64
