"""lora.base_dtype in a built run (float32, the tiny Qwen3-MoE imported with adapters on its attention, dense MLP
and routed experts): the frozen base is really held low-precision (bf16: every frozen linear and embedding weight
and every expert weight; NF4: the adapted projections and the experts 4-bit, the embedding and head bf16) and
nothing keeps a float copy of it, not the model, not the optimizer (state for the adapters only, in float32), not
after adaptive events that add and remove experts (nor the discarded expert remembered for reuse), and no stored
weight outlives its expert; frozen weights get no gradient and no gradient all-reduce. A bf16 base gives the
adapter gradients of a float32 model whose base is the bf16-rounded weights; an NF4 run's forward equals a float
run built from its dequantised base."""

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from hf_tiny import moe_run_settings, randomize, save_moe_run_files, tiny_model, train_recorded  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.models import lora as lora_api  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.moe import MoEConfig, nf4  # noqa: E402
from dynmoe_dist.moe.adapters import is_adapter  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers  # noqa: E402
from dynmoe_dist.parallel.grads import split_params  # noqa: E402

pytest.importorskip("torchao")

TARGETS = ("attention", "dense_mlp", "routed_experts")
LORA = ("lora.enabled=true", "lora.rank=2", f"lora.targets={list(TARGETS)}")
TOP_ANY = ("moe.router='top_any'", "moe.calibrate_k=1", "moe.calibrate_samples=16", "train.seed=2")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return save_moe_run_files(tmp_path_factory.mktemp("lora-base"), "qwen3_moe", 8)


def trainer(root, base_dtype, *extra, out="out"):
    from dynmoe_dist.train.loop import Trainer

    settings = moe_run_settings(root / "qwen3_moe", root / "corpus.txt", 1, *LORA, *extra, steps=6, batch=7)
    overrides = [*settings, "train.precision='float32'", f"lora.base_dtype='{base_dtype}'"]
    return Trainer(load_config(None, [*overrides, f"output.out_dir='{root / out / base_dtype}'"]))


def base_weights(model):
    """name -> every weight the base stores low-precision: expert weights, frozen linear and embedding weights."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            found[f"{name}.weight"] = module.weight
    for _, layer in find_moe_layers(model):
        for slot, expert in enumerate(layer.experts.experts):
            found |= {f"{id(layer)}.{slot}.{n}": getattr(expert, n) for n in ("w_gate", "w_in", "w_out")}
    return found


def expected_kind(name, base_dtype):
    """How ``name`` is stored: bf16 everywhere; NF4 for the experts and adapted projections (embedding, head bf16)."""
    if base_dtype == "bfloat16" or "embed_tokens" in name or "lm_head" in name:
        return "bf16"
    return "nf4"


def kind(t):
    return "nf4" if nf4.is_nf4(t) else "bf16" if t.dtype == torch.bfloat16 else "float"


def float_tensors_shaped_like(shapes, keep):
    """Every live float32 tensor (outside ``keep``) with a base weight's shape: a float copy of the base."""
    gc.collect()
    found = []
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and not nf4.is_nf4(obj) and obj.dtype == torch.float32 and id(obj) not in keep:
            if tuple(obj.shape) in shapes:
                found.append(tuple(obj.shape))
    return found


def stored_tensors_shaped_like(shapes):
    """Every live bf16 or NF4 tensor with a base weight's shape."""
    gc.collect()
    return [o for o in gc.get_objects() if torch.is_tensor(o) and kind(o) != "float" and tuple(o.shape) in shapes]


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_a_run_holds_its_base_low_precision_through_events(root, base_dtype):
    run = trainer(root, base_dtype, *TOP_ANY)
    model, optimizer = run.parts.model, run.parts.optimizer
    from dynmoe_dist.train.run import calibrate_at_start

    calibrate_at_start(run)
    _, _, _, events = train_recorded(run, 6)
    assert any(removed for *_, removed, _, _ in events) and any(added for *_, added, _ in events), events
    stored = base_weights(model)
    for name, p in stored.items():
        assert kind(p) == expected_kind(name, base_dtype) and not p.requires_grad and p.grad is None, name
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert {id(p) for p in optimizer.state} == {id(params[n]) for n in trainable}
    synced = split_params(model, run.parts.experts.shards).all_params()  # what GradSync all-reduces
    assert {id(p) for p in synced} == {id(params[n]) for n in trainable}
    for state in optimizer.state.values():
        assert all(v.dtype == torch.float32 for v in state.values() if v.dim() > 0)
    low = [p for p in stored.values() if kind(p) != "float"]
    for p in low:  # bf16: 2 bytes a weight; NF4: 4-bit codes, int8 block scales, their factors (test_qlora: at scale)
        bound = 2 * p.numel() if kind(p) == "bf16" else p.numel() * (0.5 + 5 / 64) + 68  # codes, scales, LUT
        assert nf4.stored_bytes(p) <= bound, (tuple(p.shape), kind(p))
    shapes = {tuple(p.shape) for p in low}
    keep = {id(p) for p in params.values() if kind(p) == "float"}
    keep |= {id(v) for state in optimizer.state.values() for v in state.values()}
    keep |= {id(p.grad) for p in params.values() if p.grad is not None}
    assert any(run.parts.experts.has_discarded)  # the expert each layer discarded last: stored too
    assert float_tensors_shaped_like(shapes, keep) == []
    # and no stored weight outlives its expert (pruned, moved away, replaced by a copy): what is alive is what is held
    held = len({id(p) for p in low}) + 3 * sum(run.parts.experts.has_discarded)  # + each discarded one's weights
    assert len(stored_tensors_shaped_like(shapes)) == held


def test_an_nf4_run_computes_the_float_run_of_its_dequantised_base(root):
    """The same batch through an NF4 run's model and a float32 run's (same seed, hence the same adapters, every B
    set non-zero alike) whose base weights were set to the NF4 ones dequantised (and the bf16 ones widened): logits
    and loss equal (1e-6)."""
    qlora, ref = trainer(root, "nf4", out="q"), trainer(root, "run", out="f")
    model, ref_model = qlora.parts.model, ref.parts.model
    ref_params = dict(ref_model.named_parameters())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if kind(p) != "float":  # NF4 dequantised, bf16 (embedding, head) widened
                ref_params[name].copy_(p.to(torch.float32))
            elif "lora_b" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
                ref_params[name].copy_(p)
    assert sum(nf4.is_nf4(p) for p in model.parameters()) >= 20
    vocab = model.transformers_model().config.vocab_size
    ids = torch.randint(2, vocab, (4, 8), generator=torch.Generator().manual_seed(2))
    with collect_aux_losses():
        out = model.transformers_model()(input_ids=ids, labels=ids)
    with collect_aux_losses():
        want = ref_model.transformers_model()(input_ids=ids, labels=ids)
    assert out.logits.abs().max() > 0.1
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=1e-6)


def adapted_model(base_dtype):
    """The tiny Qwen3-MoE (float32) with adapters (every B non-zero), its base stored as ``base_dtype`` says."""
    lora = lora_api.LoraConfig(enabled=True, rank=4, alpha=8.0, targets=TARGETS, base_dtype=base_dtype)
    ref = randomize(tiny_model("qwen3_moe", experts_implementation="eager")).float()
    model = import_moe(ref, lora_api.expert_config(MoEConfig(router="native"), lora))
    lora_api.apply_lora(model, lora)
    lora_api.init_adapters(model, 0, lora_api.held_experts(model))
    lora_api.lower_base(model, lora, torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def loss_and_grads(model, ids):
    with collect_aux_losses():
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_bf16_base_adapter_gradients_are_the_rounded_float_models():
    model, ref = adapted_model("bfloat16"), adapted_model("run")
    with torch.no_grad():
        for (name, p), (ref_name, ref_p) in zip(model.named_parameters(), ref.named_parameters()):
            assert name == ref_name
            if p.dtype == torch.bfloat16:
                ref_p.copy_(p.float())  # the reference's base: the bf16-rounded weights, in float32
    bf16 = [n for n, p in model.named_parameters() if p.dtype == torch.bfloat16]
    assert any("experts.experts.3.w_in" in n for n in bf16) and any("q_proj.weight" in n for n in bf16)
    assert any("embed_tokens" in n for n in bf16)
    ids = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    logits, grads = loss_and_grads(model, ids)
    ref_logits, ref_grads = loss_and_grads(ref, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and all(is_adapter(n) for n in grads)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    for name in bf16:
        assert model.get_parameter(name).grad is None, name


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_an_expert_copy_holds_the_stored_bits_and_leaves_the_generator(base_dtype):
    """experts.copy_expert (an event's added expert placed on each holder): the stored weights' tensors equal bit for
    bit (no re-quantising), adapters train, and the global generator is where it was (ranks copy different counts)."""
    from dynmoe_dist.moe.experts import copy_expert, expert_param_shapes, stored_expert_with
    from dynmoe_dist.moe.frozen_base import storage_tensors

    config = MoEConfig(dim=16, ffn_dim=32, num_experts=2, adapter_rank=2, adapter_alpha=4.0, base_dtype=base_dtype)
    torch.manual_seed(0)
    params = [torch.randn(shape) for shape in expert_param_shapes(config)]
    original = stored_expert_with(params, config)
    state = torch.get_rng_state()
    copy = copy_expert(original, config)
    assert torch.equal(torch.get_rng_state(), state)
    for old, new in zip(original.parameters(), copy.parameters()):
        assert old.requires_grad == new.requires_grad and kind(old) == kind(new)
        assert all(torch.equal(a, b) for a, b in zip(storage_tensors(old), storage_tensors(new)))
    assert kind(copy.w_in) == ("bf16" if base_dtype == "bfloat16" else "nf4") and copy.lora_a_in.requires_grad


@pytest.mark.parametrize("shape", [(16, 32), (32, 32), (512, 256)])
def test_every_tensor_of_a_stored_base_travels_as_bytes(shape):
    """parallel.migrate sends a stored base as the bytes of its inner tensors; a small NF4 weight (one scaler
    block) holds its quantisation factor as (1,) with stride (8,), which a plain byte view refuses."""
    import torch

    from dynmoe_dist.moe.frozen_base import storage_tensors
    from dynmoe_dist.moe.nf4 import to_nf4
    from dynmoe_dist.parallel.migrate import _as_bytes

    for t in storage_tensors(to_nf4(torch.randn(*shape))):
        raw = _as_bytes(t)
        assert raw.dtype == torch.uint8 and raw.numel() == t.numel() * t.element_size()
        assert torch.equal(raw.view(t.dtype).reshape(t.shape), t)


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_a_step_keeps_no_widened_copy_of_a_stored_weight_for_the_backward(base_dtype):
    """moe/frozen_base.linear_of widens a stored weight for the matmul and again in the backward: autograd saves
    no float32 tensor of a weight's shape (else the whole base is held in float32 during a step), and the input's
    gradient equals F.linear's on the widened weight."""
    import torch
    import torch.nn.functional as F

    from dynmoe_dist.moe.frozen_base import linear_of, stored

    weight = stored(torch.randn(64, 32), base_dtype)
    x = torch.randn(5, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear_of(x, weight)
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape in ((64, 32), (32, 64))]
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    wide = weight.to(torch.float32)
    x_ref = x.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.linear(x_ref, wide).square().sum(), x_ref)
    assert torch.equal(out, F.linear(x.detach(), wide)) and torch.allclose(grad, want, rtol=1e-6, atol=1e-6)
