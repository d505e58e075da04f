"""Skewed routing on 4 ranks: one expert takes half of all rows. With the planner's replication the
rows each rank actually receives (counted by the dispatcher) have max/mean <= 1.25; without it >= 2."""

import torch

from dynmoe_dist.moe import MoEConfig, MoELayer
from dynmoe_dist.moe.routing import Routing
from dynmoe_dist.parallel.expert_parallel import parallelize
from dynmoe_dist.parallel.groups import build_groups
from dynmoe_dist.parallel.simulate import run_simulated
from dynmoe_dist.planning.packing import pack_experts
from dynmoe_dist.planning.placement import Placement

E, D, TOKENS = 8, 8, 700


def skewed_routing(num_tokens, seed):
    """Every token picks expert 0 plus one other expert uniformly: expert 0 gets half of all rows."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(num_tokens, E, dtype=torch.bool)
    mask[:, 0] = True
    mask[torch.arange(num_tokens), torch.randint(1, E, (num_tokens,), generator=g)] = True
    weights = mask / 2.0
    return Routing(mask, weights, mask.sum(-1), mask.float(), None)


def rows_received(replicate: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = build_groups(4)
    loads = skewed_routing(4 * TOKENS, 0).mask.sum(0).double().tolist()  # what a window would record
    homes = [Placement.balanced(E, 4).holders(e) for e in range(E)]
    placement, _ = pack_experts(loads, homes, 4, replicate_factor=1.5, max_replicas=0 if replicate else 1)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(dim=D, ffn_dim=D, num_experts=E))
    parallelize(layer, groups, [placement])
    routing = skewed_routing(4 * TOKENS, 0)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    local = Routing(routing.mask[mine], routing.weights[mine], routing.num_selected[mine], routing.gates[mine])
    rows, counts, meta = layer.dispatcher.dispatch(torch.randn(TOKENS, D), local)
    layer.dispatcher.combine(layer.experts(rows, counts), meta)
    return rows.shape[0], placement.num_replicas(0)


def both():
    return rows_received(True), rows_received(False)


def test_replication_balances_the_rows_each_rank_receives():
    results = run_simulated(both, 4, timeout_s=120)
    with_rep = [r[0][0] for r in results]
    without = [r[1][0] for r in results]
    assert sum(with_rep) == sum(without) == 2 * 4 * TOKENS  # every routed row arrives exactly once
    assert results[0][0][1] >= 2 and results[0][1][1] == 1
    mean = sum(with_rep) / 4
    assert max(with_rep) / mean <= 1.25, with_rep
    assert max(without) / mean >= 2.0, without
