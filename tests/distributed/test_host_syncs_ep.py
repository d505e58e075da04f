"""Under expert parallelism one MoE layer forward+backward reads sizes back to the host once (the
expert counts and split sizes, in one read after the count exchange), also with a replicated expert
and with a rank that has no tokens. Counted as in tests/unit/test_host_syncs.py."""

import torch

from dynmoe_dist.bench.host_reads import HostReadCounter
from dynmoe_dist.moe import MoEConfig, MoELayer
from dynmoe_dist.parallel.expert_parallel import parallelize
from dynmoe_dist.parallel.groups import build_groups
from dynmoe_dist.parallel.simulate import run_simulated
from dynmoe_dist.planning.placement import Placement


def count_worker(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = build_groups(world)
    counts = []
    for replicated, tokens in ((False, 9), (True, 9), (False, 0 if rank == 1 else 9)):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, router="top_any"))
        per_rank = [[0, 1, 2], [0, 3]] if replicated else None
        parallelize(layer, groups, [Placement.from_rank_lists(2, 4, per_rank)] if per_rank else None)
        x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        with HostReadCounter() as reads:
            out = layer(x)
            (out.output.sum() + out.aux_loss).backward()
        counts.append(reads.calls)
    return counts


def test_one_host_read_per_ep_layer_forward():
    for per_case in run_simulated(count_worker, 2, args=(2,), timeout_s=120):
        for calls in per_case:
            assert len(calls) == 1 and calls[0][1].startswith("dispatch.py"), calls
