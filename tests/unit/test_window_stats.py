"""WindowStats (planning/stats.py) on a hand-worked batch: counts, k histogram, unrouted sums by nearest
expert, merging by addition and the flat form that crosses process boundaries."""

import torch

from dynmoe_dist.planning.stats import WindowStats

T_, F_ = True, False
# E = 3 experts, D = 2, max_experts 4 -> K = 5 histogram bins (k = 0..4).
SELECTED = torch.tensor(
    [
        [T_, F_, T_],  # t0: k = 2 (e0, e2)
        [F_, F_, F_],  # t1: k = 0, scores [.1, .9, .3] -> nearest e1, x = (1, 2)
        [F_, T_, F_],  # t2: k = 1 (e1)
        [F_, F_, F_],  # t3: k = 0, scores [.8, .2, .5] -> nearest e0, x = (3, -1)
        [F_, F_, F_],  # t4: k = 0, scores [.2, .7, .1] -> nearest e1, x = (.5, .5)
        [T_, T_, F_],  # t5: k = 2 (e0, e1)
        [T_, F_, F_],  # t6: k = 1 (e0)
    ]
)
SCORES = torch.tensor(
    [
        [0.9, 0.1, 0.8],
        [0.1, 0.9, 0.3],
        [0.2, 0.6, 0.1],
        [0.8, 0.2, 0.5],
        [0.2, 0.7, 0.1],
        [0.7, 0.6, 0.1],
        [0.9, 0.0, 0.0],
    ]
)
X = torch.tensor([[9.0, 9.0], [1.0, 2.0], [9.0, 9.0], [3.0, -1.0], [0.5, 0.5], [9.0, 9.0], [9.0, 9.0]])
# counts: e0 <- t0, t5, t6 = 3; e1 <- t2, t5 = 2; e2 <- t0 = 1
COUNTS = [3.0, 2.0, 1.0]
# k histogram: k=0: t1, t3, t4; k=1: t2, t6; k=2: t0, t5
K_HIST = [3.0, 2.0, 2.0, 0.0, 0.0]
# unrouted sums by nearest expert: e0 <- t3 (3, -1); e1 <- t1 + t4 = (1.5, 2.5); e2 nothing
UNROUTED = [[3.0, -1.0], [1.5, 2.5], [0.0, 0.0]]
NUM_UNROUTED = [1.0, 2.0, 0.0]


def _recorded():
    stats = WindowStats.empty(3, 2, 4)
    stats.add_tokens(SELECTED, SCORES, X)
    return stats


def test_empty_has_the_documented_shapes_in_float64():
    s = WindowStats.empty(3, 2, 4)
    shapes = [tuple(t.shape) for t in (s.counts_E, s.unrouted_sum_ED, s.num_unrouted_E, s.k_hist_K)]
    assert shapes == [(3,), (3, 2), (3,), (5,)]
    for t in (s.counts_E, s.unrouted_sum_ED, s.num_unrouted_E, s.k_hist_K):
        assert t.dtype == torch.float64 and t.device.type == "cpu" and not t.any()
    assert s.num_tokens == 0.0 and s.num_unrouted == 0.0


def test_add_tokens_hand_worked_batch():
    s = _recorded()
    assert s.counts_E.tolist() == COUNTS
    assert s.k_hist_K.tolist() == K_HIST
    assert s.unrouted_sum_ED.tolist() == UNROUTED
    assert s.num_unrouted_E.tolist() == NUM_UNROUTED
    assert s.num_tokens == 7.0 and s.num_unrouted == 3.0
    assert s.unrouted_sum_D.tolist() == [4.5, 1.5]  # (3 + 1.5, -1 + 2.5)
    assert all(t.dtype == torch.float64 for t in (s.counts_E, s.unrouted_sum_ED, s.num_unrouted_E, s.k_hist_K))


def test_add_tokens_accumulates_over_batches_and_detaches():
    s = _recorded()
    x = X.clone().requires_grad_()
    s.add_tokens(SELECTED, SCORES.clone().requires_grad_(), x)  # same batch again: everything doubles
    assert s.counts_E.tolist() == [6.0, 4.0, 2.0]
    assert s.k_hist_K.tolist() == [6.0, 4.0, 4.0, 0.0, 0.0]
    assert s.unrouted_sum_ED.tolist() == [[6.0, -2.0], [3.0, 5.0], [0.0, 0.0]]
    assert s.num_unrouted_E.tolist() == [2.0, 4.0, 0.0]
    assert not s.unrouted_sum_ED.requires_grad


def test_k_above_max_experts_lands_in_the_last_bin():
    # max_experts 1 -> bins k = 0, 1; the k = 2 tokens (t0, t5) are clamped into bin 1 with t2, t6.
    s = WindowStats.empty(3, 2, 1)
    s.add_tokens(SELECTED, SCORES, X)
    assert s.k_hist_K.tolist() == [3.0, 4.0]


def test_merge_adds_every_field_and_leaves_both_inputs():
    a = _recorded()
    b = WindowStats.empty(3, 2, 4)
    b.add_tokens(SELECTED[:3], SCORES[:3], X[:3] * 2)  # t0, t1 (x = (2, 4), nearest e1), t2
    merged = a.merge(b)
    assert merged.counts_E.tolist() == [4.0, 3.0, 2.0]  # [3, 2, 1] + [1, 1, 1]
    assert merged.k_hist_K.tolist() == [4.0, 3.0, 3.0, 0.0, 0.0]  # + [1, 1, 1, 0, 0]
    assert merged.unrouted_sum_ED.tolist() == [[3.0, -1.0], [3.5, 6.5], [0.0, 0.0]]
    assert merged.num_unrouted_E.tolist() == [1.0, 3.0, 0.0]
    assert a.counts_E.tolist() == COUNTS and b.counts_E.tolist() == [1.0, 1.0, 1.0]


def test_flat_layout_and_round_trip():
    s = _recorded()
    flat = s.to_flat()
    # counts (3) | unrouted sums row-major (3 x 2) | unrouted counts (3) | k histogram (5)
    assert flat.tolist() == COUNTS + [3.0, -1.0, 1.5, 2.5, 0.0, 0.0] + NUM_UNROUTED + K_HIST
    back = WindowStats.from_flat(flat.float(), 3, 2)  # float32 on the wire comes back as float64
    assert back.counts_E.tolist() == COUNTS and back.k_hist_K.tolist() == K_HIST
    assert back.unrouted_sum_ED.tolist() == UNROUTED and back.num_unrouted_E.tolist() == NUM_UNROUTED
    assert all(
        t.dtype == torch.float64 for t in (back.counts_E, back.unrouted_sum_ED, back.num_unrouted_E, back.k_hist_K)
    )
    flat64 = s.to_flat()
    again = WindowStats.from_flat(flat64, 3, 2)
    flat64.zero_()  # the parts are copies, not views of the message
    assert again.counts_E.tolist() == COUNTS and again.unrouted_sum_ED.tolist() == UNROUTED
    assert again.num_unrouted_E.tolist() == NUM_UNROUTED and again.k_hist_K.tolist() == K_HIST


def _fields(s):
    return (s.counts_E, s.unrouted_sum_ED, s.num_unrouted_E, s.k_hist_K)


def test_stats_stay_on_the_device_they_were_made_on_and_pull_batches_there():
    # The meta device stands in for the layer's accelerator on a CPU-only machine: the zeros are made
    # there, .to() moves every field there, and a CPU batch is moved to them before it is added.
    on_meta = WindowStats.empty(3, 2, 4, device="meta")
    assert [t.device.type for t in _fields(on_meta)] == ["meta"] * 4
    on_meta.add_tokens(SELECTED, SCORES, X)
    assert [t.device.type for t in _fields(on_meta)] == ["meta"] * 4
    moved = _recorded().to("meta")
    assert [(t.device.type, tuple(t.shape)) for t in _fields(moved)] == [
        ("meta", (3,)),
        ("meta", (3, 2)),
        ("meta", (3,)),
        ("meta", (5,)),
    ]
