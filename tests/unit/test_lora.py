"""LoRA (models/lora.py, moe/adapters.py): the [lora] options' one-line errors, a frozen base that gets no
gradient and no optimizer state, expert adapters that move and go with their expert, the grouped-matmul
path equal to the loop, and the whole model exactly PEFT's: the tiny Qwen3-MoE (its dense first MLP adapted),
DeepSeek-V3 (the dense first MLP and the shared experts adapted) and gpt-oss (biases, gate and up interleaved)
with PEFT 0.21's LoRA (``target_modules`` for the attention projections, ``target_parameters`` for the fused
experts and the MLPs' weights) and ours on the same weights and adapters, float64: logits, loss and every
adapter gradient to 1e-10, the adapters after three AdamW steps to 1e-9.
"""

import copy
import os
import re
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import NUM_EXPERTS, randomize, tiny_model  # noqa: E402

from dynmoe_dist.config import AdaptiveConfig  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.models.lora import (  # noqa: E402
    LoraConfig,
    apply_lora,
    expert_config,
    held_experts,
    init_adapters,
    trainable_names,
)
from dynmoe_dist.moe import MoEConfig, MoELayer  # noqa: E402
from dynmoe_dist.moe.adapters import is_adapter  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.moe.experts import ExpertBank  # noqa: E402
from dynmoe_dist.parallel.expert_parallel import parallelize  # noqa: E402
from dynmoe_dist.parallel.grads import fill_missing_grads  # noqa: E402
from dynmoe_dist.parallel.groups import single_process  # noqa: E402
from dynmoe_dist.parallel.migrate import apply_layer_plan  # noqa: E402
from dynmoe_dist.planning.planner import PlannerConfig, plan_layer  # noqa: E402
from dynmoe_dist.planning.stats import WindowStats  # noqa: E402
from dynmoe_dist.train.optim import build_optimizer  # noqa: E402

RANK, ALPHA = 4, 8.0
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FUSED = ["experts.gate_up_proj", "experts.down_proj"]
# PEFT 0.21 reads gate_proj / up_proj / down_proj in target_modules as transformers v4's expert names and retargets
# them to the fused experts (rank doubled): a dense MLP or a shared expert is named to it by its weights
# (target_parameters, a ParamWrapper of one "expert"), as the unmerged export does.
MLP_WEIGHTS = [
    f"{block}.{proj}.weight" for block in ("mlp", "shared_experts") for proj in ("gate_proj", "up_proj", "down_proj")
]
TRAIN = SimpleNamespace(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)


# -- options ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rank": 0}, r"lora.rank \(0\) must be >= 1"),
        ({"targets": ("attention", "mlp")}, r"lora.targets entry \('mlp'\) must be one of"),
        ({"router": "sometimes"}, r"lora.router \('sometimes'\) must be one of"),
    ],
)
def test_bad_options_are_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        LoraConfig(**fields)
    assert "\n" not in str(err.value)


def ours(lora=None, seed=0, family="qwen3_moe"):
    """The family's tiny model (Qwen3-MoE: a dense first layer, 6 experts) converted, LoRA applied and drawn."""
    lora = lora or LoraConfig(
        enabled=True, rank=RANK, alpha=ALPHA, targets=("attention", "dense_mlp", "routed_experts")
    )
    ref = randomize(tiny_model(family, experts_implementation="eager").double()).train()
    model = import_moe(copy.deepcopy(ref), expert_config(MoEConfig(router="native"), lora))
    apply_lora(model, lora)
    init_adapters(model, seed, held_experts(model))
    return ref, model


def test_a_target_that_names_nothing_lists_what_exists():
    with pytest.raises(ValueError, match=r"\('shared_experts'\) names nothing.*it has: attention, dense_mlp, routed"):
        ours(LoraConfig(enabled=True, targets=("attention", "shared_experts")))


def test_the_shared_expert_gate_is_no_dense_mlp():
    """Qwen2-MoE's shared_expert_gate (1, D) scales the shared expert, as a router scales the routed ones."""
    with pytest.raises(ValueError, match=r"\('dense_mlp'\) names nothing.*it has: attention, routed_experts, shared_"):
        ours(LoraConfig(enabled=True, rank=RANK, targets=("dense_mlp",)), family="qwen2_moe")


def test_a_rank_above_a_targets_smallest_dimension():
    # k_proj is (8, 16): one key/value head of 8
    with pytest.raises(ValueError, match=r"lora.rank \(9\) is above the smallest dimension of .*k_proj \(8, 16\)"):
        ours(LoraConfig(enabled=True, rank=9, targets=("attention",)))
    with pytest.raises(ValueError, match=r"lora.rank \(13\) is above .* routed expert \(16, 12\) \(12\)"):
        ours(LoraConfig(enabled=True, rank=13, targets=("routed_experts",)))


# -- a frozen base -----------------------------------------------------------------------------------------
def test_only_adapters_train_and_hold_optimizer_state():
    _, model = ours()
    names = trainable_names(model)
    assert names and all(is_adapter(n) for n in names)
    assert any(".experts.experts.0.lora_a_in" in n for n in names) and any("q_proj.lora_a" in n for n in names)
    optimizer = build_optimizer(model, TRAIN)
    ids = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with collect_aux_losses():
        model(input_ids=ids, labels=ids).loss.backward()
    fill_missing_grads([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == is_adapter(name), name
        assert (p in optimizer.state) == is_adapter(name), name


def test_a_trainable_router():
    _, model = ours(LoraConfig(enabled=True, rank=RANK, targets=("routed_experts",), router="trainable"))
    routers = {n for n in trainable_names(model) if not is_adapter(n)}
    assert routers and all(".router." in n for n in routers)


def test_the_same_adapters_whatever_holds_them():
    """An expert's adapters are drawn from the seed and its logical id, not its slot or rank."""
    _, a = ours(seed=3)
    _, b = ours(seed=3)
    layer_a, layer_b = (
        [m for m in a.modules() if isinstance(m, MoELayer)],
        [m for m in b.modules() if isinstance(m, MoELayer)],
    )
    init_adapters(b, 3, [(0, [4, 1], [layer_b[0].experts.experts[4], layer_b[0].experts.experts[1]])])
    torch.testing.assert_close(layer_a[0].experts.experts[4].lora_a_in, layer_b[0].experts.experts[4].lora_a_in)
    assert not torch.equal(layer_a[0].experts.experts[4].lora_a_in, layer_a[0].experts.experts[1].lora_a_in)
    _, c = ours(seed=4)
    assert not torch.equal(a.model.layers[1].self_attn.q_proj.lora_a, c.model.layers[1].self_attn.q_proj.lora_a)


# -- the expert bank ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ffn", "gated", "gpt_oss"])
def test_grouped_path_equals_the_loop(kind):
    config = MoEConfig(dim=16, ffn_dim=8, num_experts=3, expert_kind=kind, expert_bias=kind != "gated")
    config = expert_config(config, LoraConfig(enabled=True, rank=2))
    torch.manual_seed(0)
    bank = ExpertBank.fresh(config, 3)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_()
    rows = torch.randn(9, 16)
    counts = torch.tensor([4, 0, 5])
    config.expert_compute = "loop"
    loop = bank(rows, counts)
    config.expert_compute = "grouped_mm"
    torch.testing.assert_close(bank(rows, counts), loop, rtol=1e-4, atol=1e-4)


def _hand_made_layer():
    config = expert_config(MoEConfig(dim=4, ffn_dim=6, num_experts=4, max_experts=8), LoraConfig(enabled=True, rank=2))
    layer = MoELayer(config).double()
    with torch.no_grad():  # every parameter of expert e equals e + 1
        for e, expert in enumerate(layer.experts.experts):
            for p in expert.parameters():
                p.fill_(e + 1.0)
    return layer, parallelize(layer, single_process())[0]


def test_a_plan_prunes_adapters_with_their_expert():
    """Experts 1 and 3 pruned: 0 and 2 keep their adapters (and the adapters' Adam state), 1's go, 3's comes back
    as the reused discarded expert (its adapters with it)."""
    layer, shard = _hand_made_layer()
    optimizer = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad])
    layer.experts.experts[2].lora_b_in.grad = torch.ones_like(layer.experts.experts[2].lora_b_in)
    optimizer.step()
    moment = optimizer.state[layer.experts.experts[2].lora_b_in]["exp_avg"].clone()
    stats = WindowStats.empty(4, 4, 8)
    stats.counts_E += torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    stats.unrouted_sum_ED[0] += torch.tensor([0.0, 3.0, 4.0, 0.0], dtype=torch.float64)
    stats.num_unrouted_E[0] += 2
    config = PlannerConfig(layer.config, AdaptiveConfig(expert_init="reuse_discarded"))
    plan = plan_layer(0, stats, shard.placement, config, has_discarded=False, seed=5)
    apply_layer_plan(plan, shard, optimizer, single_process(), None)
    assert plan.removed == (1, 3) and len(layer.experts) == 3
    for slot, value in enumerate([1.0, 3.0, 4.0]):
        expert = layer.experts.experts[slot]
        assert torch.all(expert.lora_a_in == value) and torch.all(expert.w_in == value)
        assert not expert.w_in.requires_grad and expert.lora_a_in.requires_grad
    torch.testing.assert_close(optimizer.state[layer.experts.experts[1].lora_b_in]["exp_avg"], moment)
    assert all(p.requires_grad for g in optimizer.param_groups for p in g["params"])


# -- exactly PEFT's --------------------------------------------------------------------------------------------
def peft_model(ref, target_modules):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    parameters = FUSED + MLP_WEIGHTS  # the MLP weights match only where our targets put adapters (PEFT_CASES)
    config = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=target_modules, target_parameters=parameters)
    return get_peft_model(ref, config)


def peft_pairs(peft, model, interleaved):
    """(PEFT's adapter parameter, a function of ours -> the same tensor in PEFT's layout) for every adapter."""
    from peft.tuners.lora.layer import ParamWrapper

    ours_by_name = dict(model.named_parameters())
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    sparse = sorted({int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, m in peft.named_modules() if _fused(m)})
    pairs = []
    for name, module in peft.named_modules():
        if isinstance(module, ParamWrapper) and module.parameter_name == "weight":  # a dense MLP's projection
            own = name.replace("base_model.model.", "", 1)
            pairs.append((module.lora_A["default"].weight, _dense(ours_by_name[f"{own}.lora_a"])))
            pairs.append((module.lora_B["default"].weight, _dense(ours_by_name[f"{own}.lora_b"])))
        elif isinstance(module, ParamWrapper):
            experts = layers[sparse.index(int(re.search(r"layers\.(\d+)\.", name).group(1)))].experts.experts
            side = "in" if module.parameter_name == "gate_up_proj" else "out"
            pairs.append((module.lora_A["default"].weight, _fused_a(experts, side)))
            pairs.append((module.lora_B["default"].weight, _fused_b(experts, side, interleaved and side == "in")))
        elif hasattr(module, "lora_A") and "default" in module.lora_A and not isinstance(module, ParamWrapper):
            own = name.replace("base_model.model.", "", 1)
            pairs.append((module.lora_A["default"].weight, _dense(ours_by_name[f"{own}.lora_a"])))
            pairs.append((module.lora_B["default"].weight, _dense(ours_by_name[f"{own}.lora_b"])))
    return pairs


def _fused(module):
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(module, ParamWrapper) and module.parameter_name != "weight"


def _dense(param):
    return lambda grad: param.grad if grad else param


def _fused_a(experts, side):
    # PEFT: lora_A (r * E, in), expert e's rows e*r .. (e+1)*r
    return lambda grad: torch.cat([_value(getattr(e, f"lora_a_{side}"), grad) for e in experts])


def _fused_b(experts, side, interleaved):
    # PEFT: lora_B (out, r * E) read as (out, r, E): expert e's column j is j * E + e; gpt-oss's rows alternate
    # gate and up where ours hold the gate's first
    def rows(b_Nr):
        return torch.stack(b_Nr.chunk(2), 1).flatten(0, 1) if interleaved else b_Nr

    return lambda grad: torch.stack([rows(_value(getattr(e, f"lora_b_{side}"), grad)) for e in experts], -1).flatten(1)


def _value(param, grad):
    return param.grad if grad else param


def loss_of(model, ids):
    with collect_aux_losses() as aux:
        out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss + aux.total(out.logits, torch.ones_like(ids)).to(out.loss.dtype)


# family -> (our targets, PEFT's target_modules for the same projections)
PEFT_CASES = {
    "qwen3_moe": (("attention", "dense_mlp", "routed_experts"), ATTENTION),
    "deepseek_v3": (
        ("attention", "dense_mlp", "routed_experts", "shared_experts"),
        ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
    "gpt_oss": (("attention", "routed_experts"), ATTENTION),
}


@pytest.mark.parametrize("family", list(PEFT_CASES))
def test_exactly_peft(family):
    targets, target_modules = PEFT_CASES[family]
    ref, model = ours(LoraConfig(enabled=True, rank=RANK, alpha=ALPHA, targets=targets), family=family)
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        assert len(layer.experts) == NUM_EXPERTS
    with torch.no_grad():  # B starts at zero (PEFT's init); non-zero here, so that every gradient means something
        for name, p in model.named_parameters():
            if name.endswith(("lora_b", "lora_b_in", "lora_b_out")):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    peft = peft_model(ref, target_modules)
    pairs = peft_pairs(peft, model, interleaved=family == "gpt_oss")
    peft_trainable = [p for p in peft.parameters() if p.requires_grad]
    assert len(pairs) == len(peft_trainable)  # every adapter of PEFT's, as many numbers as ours
    assert sum(p.numel() for p in peft_trainable) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        for theirs, mine in pairs:
            theirs.copy_(mine(False))
    ours_opt = build_optimizer(model, TRAIN)
    their_opt = torch.optim.AdamW(
        [theirs for theirs, _ in pairs], lr=TRAIN.lr, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay, foreach=False
    )
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(2, 64, (2, 7), generator=g)
        logits_o, loss_o = loss_of(model, ids)
        logits_t, loss_t = loss_of(peft, ids)
        if step == 0:
            torch.testing.assert_close(logits_o, logits_t, rtol=0, atol=1e-10)
            torch.testing.assert_close(loss_o, loss_t, rtol=0, atol=1e-10)
        loss_o.backward()
        loss_t.backward()
        fill_missing_grads([p for p in model.parameters() if p.requires_grad])  # as GradSync does
        if step == 0:
            for theirs, mine in pairs:
                torch.testing.assert_close(mine(True), theirs.grad, rtol=0, atol=1e-10)
        ours_opt.step()
        their_opt.step()
        ours_opt.zero_grad(set_to_none=True)
        their_opt.zero_grad(set_to_none=True)
    for theirs, mine in pairs:
        torch.testing.assert_close(mine(False), theirs, rtol=0, atol=1e-9)
