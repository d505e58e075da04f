"""Sort-based permutation helpers (moe/permute.py): hand-worked inverse, stable slot sort, combine."""

import pytest
import torch

from dynmoe_dist.moe import permute
from dynmoe_dist.moe.permute import combine_rows, gather_rows, inverse_permutation, routed_pairs, sort_by_slot
from dynmoe_dist.moe.routing import Routing


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


def _routing_3x2():
    # token 0 -> e0 (w 1); token 1 -> e0, e1 (w .5, .5); token 2 -> e1 (w 1)
    mask = torch.tensor([[True, False], [True, True], [False, True]])
    weights = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    return Routing(mask, weights, mask.sum(-1), mask.float())


def test_routed_pairs_reads_the_counts_or_takes_both_counts_and_sizes():
    # Expert-major, tokens ascending: e0 has tokens 0, 1; e1 has tokens 1, 2. Counts [2, 2].
    pairs = routed_pairs(_routing_3x2())
    assert (pairs.expert_R.tolist(), pairs.token_R.tolist(), pairs.weight_R.tolist()) == (
        [0, 0, 1, 1],
        [0, 1, 1, 2],
        [1.0, 0.5, 0.5, 1.0],
    )
    assert pairs.counts_E.tolist() == [2, 2] and pairs.sizes_E == (2, 2)  # the loop's segment sizes
    # A caller that read the counts already (expert parallelism) passes both and gets the same pairs.
    given = routed_pairs(_routing_3x2(), torch.tensor([2, 2]), (2, 2))
    assert (given.token_R.tolist(), given.sizes_E) == ([0, 1, 1, 2], (2, 2))
    with pytest.raises(ValueError, match="^routed_pairs: sizes_E given without counts_E$"):
        routed_pairs(_routing_3x2(), sizes_E=(2, 2))


class _FakeKernels:
    """Stands in for the fused Triton kernels: records its arguments, returns a marker."""

    def __init__(self):
        self.calls = []

    def gather_rows(self, *args):
        self.calls.append(("gather", args))
        return "gathered by the kernel"

    def combine_rows(self, *args):
        self.calls.append(("combine", args))
        return "combined by the kernel"


def test_gather_and_combine_hand_their_arguments_to_the_selected_kernels(monkeypatch):
    fake = _FakeKernels()
    monkeypatch.setattr(permute.kernel_select, "permute_kernels", lambda t: fake)
    x, token, weight = torch.ones(3, 2), torch.tensor([2, 0]), torch.tensor([0.5, 1.0])
    assert gather_rows(x, token) == "gathered by the kernel"
    assert combine_rows(x[:2], token, weight, 3) == "combined by the kernel"
    (g_name, g_args), (c_name, c_args) = fake.calls
    assert g_name == "gather" and g_args[0] is x and g_args[1] is token and len(g_args) == 2
    assert c_name == "combine" and c_args[1] is token and c_args[2] is weight and c_args[3] == 3
    assert c_args[0].shape == (2, 2) and len(c_args) == 4
