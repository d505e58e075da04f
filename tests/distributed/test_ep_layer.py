"""Expert-parallel MoE layer == single-process layer built from the same weights: outputs and
gradients (input, router, every expert), float64, world sizes 1-4, E in {4, 5, 8}, every ep size,
uneven tokens per rank (a rank with none), all-k=0 batches and replicated placements (also with LoRA adapters
on frozen experts, and with experts that train differently: some whole, some their adapters only or nothing).

One simulated cluster per world size runs every case (process start-up dominates otherwise).
"""

import pytest
import torch

from dynmoe_dist.moe import MoEConfig, MoELayer
from dynmoe_dist.parallel.expert_parallel import parallelize
from dynmoe_dist.parallel.grads import GradSync
from dynmoe_dist.parallel.groups import build_groups, single_process
from dynmoe_dist.parallel.simulate import run_simulated
from dynmoe_dist.planning.placement import Placement

D, F = 8, 12
TOKENS = [7, 0, 12, 3]  # tokens per rank at worlds 3 and 4: uneven, rank 1 has none
# World 2: both ranks hold tokens, so in every ep-2 case each rank receives rows from BOTH ranks for
# several of its experts, and the receive side must reorder them source-major -> expert-major (with
# rank 1 empty that reordering was the identity, and a combine that re-applied it passed at world 2).
TOKENS_WORLD_2 = [9, 6]


def _tokens(world):
    return TOKENS_WORLD_2 if world == 2 else TOKENS


def _cases(world):
    ep_sizes = [ep for ep in range(1, world + 1) if world % ep == 0]
    cases = []
    for num_experts in (4, 5, 8):
        for ep in ep_sizes:
            cases.append(dict(E=num_experts, ep=ep, router="top_any", seed=len(cases)))
    for router in ("top_k", "top_p"):
        cases.append(dict(E=5, ep=world, router=router, seed=len(cases)))
    cases.append(dict(E=4, ep=world, router="top_any", seed=99, all_k0=True))
    if world >= 2:
        # expert 0 replicated on every rank; the others spread round-robin after it
        per_rank = [[0] for _ in range(world)]
        for e in range(1, 5):
            per_rank[(e - 1) % world].append(e)
        cases.append(dict(E=5, ep=world, router="top_any", seed=7, experts_per_rank=per_rank))
        # the same under LoRA: the experts' weights frozen, the replicas' adapter gradients summed
        cases.append(dict(E=5, ep=world, router="top_any", seed=8, experts_per_rank=per_rank, adapter_rank=2))
        # experts of one layer that train differently: under lora.added_experts = 'trainable' an added expert trains
        # whole beside experts that train their adapters only (the replicated one either); without expert adapters
        # the base experts are frozen whole (the replicated one among them) beside added ones that train
        lora = dict(E=5, ep=world, router="top_any", experts_per_rank=per_rank, adapter_rank=2, added="trainable")
        cases.append(dict(lora, seed=9, whole=(0, 3)))
        cases.append(dict(lora, seed=10, whole=(3,)))
        cases.append(dict(E=5, ep=world, router="top_any", seed=11, experts_per_rank=per_rank, frozen=(0, 2)))
    return cases


def _layer(case):
    torch.manual_seed(case["seed"])
    cfg = MoEConfig(
        dim=D,
        ffn_dim=F,
        num_experts=case["E"],
        router=case["router"],
        top_k=2,
        aux_losses=None if case["router"] != "top_any" else ("diverse", "simple", "load_balance", "efficiency"),
        adapter_rank=case.get("adapter_rank", 0),
        adapter_alpha=4.0 if case.get("adapter_rank") else 0.0,
        added_experts=case.get("added", "copy"),
    )
    layer = MoELayer(cfg).double()
    for p in layer.experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    for expert in case.get("whole", ()):
        layer.experts.experts[expert].requires_grad_(True)
    for expert in case.get("frozen", ()):
        layer.experts.experts[expert].requires_grad_(False)
    if case.get("all_k0"):
        with torch.no_grad():
            layer.router.threshold.fill_(10.0)
    return layer


def _inputs(case, world):
    g = torch.Generator().manual_seed(1000 + case["seed"])
    total = sum(_tokens(world)[:world])
    return torch.randn(total, D, generator=g, dtype=torch.float64), torch.randn(
        total, D, generator=g, dtype=torch.float64
    )


def _token_slice(rank, world):
    tokens = _tokens(world)
    lo = sum(tokens[:rank])
    return slice(lo, lo + tokens[rank])


def _run_case(case, layer, shards, x, cot, groups):
    x = x.clone().requires_grad_()
    res = layer(x)
    ((res.output * cot).sum() + res.aux_loss).backward()
    GradSync(layer, groups).sync(shards)
    experts = {e: [p.grad.clone() for p in m.parameters() if p.requires_grad] for e, m in shards[0].local_modules()}
    return dict(
        output=res.output.detach(),
        x_grad=x.grad,
        aux=res.aux_loss.detach(),
        router=[p.grad.clone() for p in layer.router.parameters()],
        experts=experts,
        rows_sent=getattr(getattr(layer.dispatcher, "comm", None), "rows_sent", None),
        routed=int(res.routing.mask.sum()),
    )


def ep_worker(world):
    import torch.distributed as dist

    rank = dist.get_rank()
    groups_by_ep, results = {}, []
    for case in _cases(world):
        groups = groups_by_ep.setdefault(case["ep"], build_groups(case["ep"]))
        layer = _layer(case)
        placement = None
        if "experts_per_rank" in case:
            placement = [Placement.from_rank_lists(world, case["E"], case["experts_per_rank"])]
        shards = parallelize(layer, groups, placement)
        x, cot = _inputs(case, world)
        sl = _token_slice(rank, world)
        results.append(_run_case(case, layer, shards, x[sl], cot[sl], groups))
    return results


def _reference(case, world):
    layer = _layer(case)  # the plain layer: one process, every expert local, in logical order
    x, cot = _inputs(case, world)
    return _run_case(case, layer, parallelize(layer, single_process()), x, cot, single_process())


@pytest.fixture(scope="module", params=[2, 3, 4])
def cluster(request):
    world = request.param
    return world, run_simulated(ep_worker, world, args=(world,), timeout_s=240)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def test_ep_layer_matches_single_process(cluster):
    world, per_rank = cluster
    for index, case in enumerate(_cases(world)):
        ref = _reference(case, world)
        ranks = [r[index] for r in per_rank]
        label = f"world={world} case={case}"
        _close(torch.cat([r["output"] for r in ranks]), ref["output"], f"{label} output")
        _close(torch.cat([r["x_grad"] for r in ranks]), ref["x_grad"], f"{label} input grad")
        _close(sum(r["aux"] for r in ranks), ref["aux"], f"{label} aux loss (sum over ranks)")
        for r in ranks:  # routers are dense: every rank holds the full gradient after sync
            for g, want in zip(r["router"], ref["router"]):
                _close(g, want, f"{label} router grad")
        seen = set()
        for r in ranks:
            for expert, grads in r["experts"].items():
                seen.add(expert)
                for g, want in zip(grads, ref["experts"][expert]):
                    _close(g, want, f"{label} expert {expert} grad")
        assert seen == set(range(case["E"])), f"{label}: experts held {sorted(seen)}"


def test_wire_carries_exactly_the_routed_rows(cluster):
    world, per_rank = cluster
    for index, case in enumerate(_cases(world)):
        if case["ep"] == 1:
            continue
        for r in per_rank:
            assert r[index]["rows_sent"] == r[index]["routed"], f"world={world} case={case}"


def test_world_one_parallelize_is_identity():
    case = dict(E=5, ep=1, router="top_any", seed=3)
    layer = _layer(case)
    shards = parallelize(layer, single_process())
    x, cot = _inputs(case, 1)
    got, ref = _run_case(case, layer, shards, x, cot, single_process()), _reference(case, 1)
    _close(got["output"], ref["output"], "output")
    assert shards[0].placement.num_experts == 5 and len(layer.experts) == 5
    assert shards[0].local_experts == [0, 1, 2, 3, 4] and shards[0].owned_modules() == list(shards[0].local_modules())
