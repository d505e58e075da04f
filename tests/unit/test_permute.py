"""Sort-based permutation helpers (moe/permute.py): hand-worked inverse, stable slot sort, combine."""

import torch

from dynmoe_dist.moe.permute import combine_rows, inverse_permutation, sort_by_slot


def test_inverse_permutation_hand_worked():
    # order [2, 0, 3, 1]: inverse[order[i]] = i -> inverse[2] = 0, inverse[0] = 1, inverse[3] = 2, inverse[1] = 3
    order = torch.tensor([2, 0, 3, 1])
    inverse = inverse_permutation(order)
    assert inverse.tolist() == [1, 3, 0, 2]
    x = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert x[order][inverse].tolist() == x.tolist()
    assert inverse_permutation(torch.zeros(0, dtype=torch.long)).tolist() == []


def test_slot_sort_is_stable_for_many_equal_slots():
    # 120 rows over 3 slots (slot of row i = (7 i) mod 3): within a slot the rows must keep their
    # ascending order (the expert-major, token-ascending layout); an unstable sort reorders them on CPU
    # from about 100 rows on.
    slot_R = torch.tensor([(7 * i) % 3 for i in range(120)])
    order, counts = sort_by_slot(slot_R, 4)
    want = sorted(range(120), key=lambda i: ((7 * i) % 3, i))
    assert order.tolist() == want
    assert counts.tolist() == [40, 40, 40, 0]


def test_combine_rows_weights_and_leaves_tokens_without_rows_at_zero():
    # rows: r0 -> token 2 (w .5), r1 -> token 0 (w 1), r2 -> token 2 (w .25); token 1 gets no row.
    rows = torch.tensor([[2.0, 4.0, 6.0], [1.0, 1.0, 1.0], [4.0, 0.0, 8.0]])
    out = combine_rows(rows, torch.tensor([2, 0, 2]), torch.tensor([0.5, 1.0, 0.25]), 3)
    assert out.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 2.0, 5.0]]  # .5*r0 + .25*r2 = [1+1, 2+0, 3+2]
