"""Permute + grouped experts + combine equals a naive per-token loop (float64), outputs and gradients."""

import pytest
import torch
from dynmoe_dist.kernels.grouped_gemm import grouped_mm, grouped_mm_reference, grouped_mm_supports

from dynmoe_dist.moe import ExpertBank, MoEConfig
from dynmoe_dist.moe.experts import reference_forward
from dynmoe_dist.moe.layer import LocalDispatcher
from dynmoe_dist.moe.permute import replica_index, routed_pairs, sort_by_slot
from dynmoe_dist.moe.routing import Routing

D, F, E = 6, 10, 5


def _bank(mode, seed=0, dim=D, ffn_dim=F):
    torch.manual_seed(seed)
    cfg = MoEConfig(dim=dim, ffn_dim=ffn_dim, num_experts=E, expert_compute=mode)
    bank = ExpertBank.fresh(cfg, E).double()
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return bank


def _random_routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, E + 1, (T,), generator=g)  # every k from 0 to E
    scores = torch.rand(T, E, generator=g)
    ranks = scores.argsort(-1).argsort(-1)
    mask = ranks >= (E - k).unsqueeze(-1)
    weights = (torch.rand(T, E, generator=g, dtype=torch.float64) * mask).requires_grad_()
    return Routing(mask, weights, mask.sum(-1), mask.double(), None)


def _naive(x, routing, bank):
    out = torch.zeros_like(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(D, dtype=x.dtype)
        for e in range(E):
            if routing.mask[t, e]:
                acc = acc + routing.weights[t, e] * bank.experts[e](x[t : t + 1])[0]
        rows.append(acc)
    return torch.stack(rows) if rows else out


@pytest.mark.parametrize("mode", ["loop", "grouped_mm"])
@pytest.mark.parametrize("T, seed", [(0, 0), (1, 1), (7, 2), (40, 3)])
def test_dispatch_combine_matches_naive_loop(mode, T, seed):
    bank = _bank(mode)
    routing = _random_routing(T, seed)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    dispatcher = LocalDispatcher()
    rows, counts, meta = dispatcher.dispatch(x, routing)
    assert rows.shape[0] == int(routing.mask.sum())  # exactly the routed rows, no padding
    out = dispatcher.combine(bank(rows, counts), meta)
    ref = _naive(x, routing, bank)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if T == 0:
        return
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, routing.weights, *bank.parameters()], cot, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [x, routing.weights, *bank.parameters()], cot, allow_unused=True)
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None or g.abs().sum() == 0
        else:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_experts_with_no_rows_and_all_k_zero():
    bank = _bank("loop")
    mask = torch.zeros(5, E, dtype=torch.bool)
    mask[:, 2] = True  # only expert 2 is used
    routing = Routing(mask, mask.double(), mask.sum(-1), mask.double(), None)
    x = torch.randn(5, D, dtype=torch.float64)
    d = LocalDispatcher()
    rows, counts, meta = d.dispatch(x, routing)
    assert counts.tolist() == [0, 0, 5, 0, 0]
    torch.testing.assert_close(d.combine(bank(rows, counts), meta), bank.experts[2](x))
    empty = Routing(
        torch.zeros(5, E, dtype=torch.bool),
        torch.zeros(5, E, dtype=torch.float64),
        torch.zeros(5, dtype=torch.long),
        torch.zeros(5, E),
        None,
    )
    rows, counts, meta = d.dispatch(x, empty)
    assert rows.shape == (0, D)
    assert d.combine(bank(rows, counts), meta).abs().sum() == 0


def test_bank_matches_row_by_row_reference():
    bank = _bank("grouped_mm")
    counts = torch.tensor([3, 0, 2, 1, 4])
    rows = torch.randn(10, D, dtype=torch.float64)
    torch.testing.assert_close(bank(rows, counts), reference_forward(bank.experts, rows, counts))


def test_routed_pairs_are_expert_major():
    # token 0 -> e1, e2; token 1 -> e0; token 2 -> e2
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    pairs = routed_pairs(Routing(mask, mask.float(), mask.sum(-1), mask.float(), None))
    assert pairs.expert_R.tolist() == [0, 1, 2, 2]
    assert pairs.token_R.tolist() == [1, 0, 0, 2]
    assert pairs.counts_E.tolist() == [1, 1, 2]


def test_replica_split_and_slot_sort():
    # expert 0 has 5 rows and 2 replicas -> rows 0..2 to replica 0? floor(j*2/5): j=0,1,2 -> 0; j=3,4 -> 1
    counts = torch.tensor([5, 2])
    expert = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    assert replica_index(counts, expert, torch.tensor([2, 1])).tolist() == [0, 0, 0, 1, 1, 0, 0]
    order, per_slot = sort_by_slot(torch.tensor([2, 0, 2, 1, 0]), 4)
    assert order.tolist() == [1, 4, 3, 0, 2]
    assert per_slot.tolist() == [2, 1, 2, 0]


def test_grouped_mm_kernel_matches_loop_in_fp32():
    # dims whose fp32 rows are 16-byte aligned, so the real torch._grouped_mm kernel runs
    loop, grouped = _bank("loop", dim=8, ffn_dim=16).float(), _bank("grouped_mm", dim=8, ffn_dim=16).float()
    counts = torch.tensor([30, 0, 12, 1, 7])
    rows = torch.randn(50, 8, requires_grad=True)
    assert grouped_mm_supports(rows, torch.zeros(5, 8, 16))
    out_loop, out_grouped = loop(rows, counts), grouped(rows, counts)
    torch.testing.assert_close(out_grouped, out_loop, rtol=1e-5, atol=1e-5)
    g_loop = torch.autograd.grad(out_loop.sum(), [rows, *loop.parameters()], allow_unused=True)
    g_grp = torch.autograd.grad(out_grouped.sum(), [rows, *grouped.parameters()], allow_unused=True)
    for a, b in zip(g_loop, g_grp):
        if a is None:  # expert 1 got no rows: loop leaves its grads unset, grouped gives zeros
            assert b is None or b.abs().sum() == 0
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows_dtype, needs",
    [
        (torch.float64, (True, True)),
        (torch.float64, (True, False)),
        (torch.float64, (False, True)),
        (torch.bfloat16, (True, True)),
    ],
)
def test_combine_rows_matches_mul_index_add_composition(rows_dtype, needs):
    # combine_rows is one autograd node with a hand-written backward; the plain composition is the spec.
    from dynmoe_dist.moe.permute import combine_rows

    g = torch.Generator().manual_seed(0)
    token = torch.tensor([2, 0, 2, 1, 0])  # token 2 gets two rows, token 3 none
    rows = torch.randn(5, D, generator=g, dtype=torch.float64).to(rows_dtype).requires_grad_(needs[0])
    weight = torch.rand(5, generator=g, dtype=torch.float32).requires_grad_(needs[1])
    cot = torch.randn(4, D, generator=g, dtype=torch.float64).to(rows_dtype)
    out = combine_rows(rows, token, weight, 4)
    ref = torch.zeros(4, D, dtype=rows_dtype).index_add(0, token, rows * weight.to(rows_dtype).unsqueeze(-1))
    torch.testing.assert_close(out, ref)
    assert out[3].abs().sum() == 0
    inputs = [t for t in (rows, weight) if t.requires_grad]
    # bf16: both round the weight gradient's dot product to bf16, in a different order.
    tol = dict(rtol=1.6e-2, atol=1e-2) if rows_dtype == torch.bfloat16 else {}
    for mine, want in zip(torch.autograd.grad(out, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
        assert mine.dtype == want.dtype
        torch.testing.assert_close(mine, want, **tol)


def test_grouped_mm_kernel_matches_its_reference():
    torch.manual_seed(0)
    a, b = torch.randn(40, 16), torch.randn(3, 16, 8)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)  # the middle segment is empty
    assert grouped_mm_supports(a, b)
    torch.testing.assert_close(grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs), rtol=1e-5, atol=1e-5)
    assert not grouped_mm_supports(a.double(), b.double())  # float64 takes the reference path


def test_replica_row_counts_match_replica_index():
    """The per-replica counts computed from the expert counts alone equal what replica_index assigns."""
    import torch

    from dynmoe_dist.moe.permute import replica_index, replica_row_counts

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        num_experts = int(torch.randint(1, 6, (1,), generator=g))
        counts_E = torch.randint(0, 9, (num_experts,), generator=g)
        num_replicas_E = torch.randint(1, 4, (num_experts,), generator=g)
        expert_R = torch.repeat_interleave(torch.arange(num_experts), counts_E)
        replica_R = replica_index(counts_E, expert_R, num_replicas_E)
        expected = torch.zeros(num_experts, 3, dtype=torch.long)
        expected.index_put_((expert_R, replica_R), torch.ones_like(expert_R), accumulate=True)
        assert torch.equal(replica_row_counts(counts_E, num_replicas_E, 3), expected)
    # hand case: 5 rows over 2 replicas -> rows 0-2 (floor(2j/5) = 0 for j < 2.5) and 3-4
    assert replica_row_counts(torch.tensor([5]), torch.tensor([2]), 3).tolist() == [[3, 2, 0]]
