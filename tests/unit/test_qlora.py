"""QLoRA (lora.base_dtype = 'nf4', moe/nf4.py): the tiny Qwen3-MoE with adapters on its attention projections,
its dense MLP and every routed expert, its base stored NF4. Its forward (logits and loss, float32) equals a float
model built from the dequantised base with the same adapters (1e-6); the adapters' gradients equal the float
model's and the NF4 base gets none; the stored base is under 4.5 bits a weight (4.2 at the test's sizes, QLoRA's
4.127 at scale); the expert bank runs its per-expert loop on NF4 experts; 'nf4' without torchao is one line naming
the option and the install, and so is 'nf4' with expert FSDP.
"""

import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from hf_tiny import randomize, tiny_model  # noqa: E402

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.models import lora as lora_api  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.moe import MoEConfig, MoELayer, nf4  # noqa: E402
from dynmoe_dist.moe.adapters import is_adapter  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402

pytest.importorskip("torchao")

TARGETS = ("attention", "dense_mlp", "routed_experts")
QLORA = lora_api.LoraConfig(enabled=True, rank=4, alpha=8.0, targets=TARGETS, base_dtype="nf4")


def qlora_model(lora, **overrides):
    """The tiny Qwen3-MoE (float32) imported with LoRA on ``TARGETS`` and drawn; every B made non-zero so the
    adapters change the output."""
    ref = randomize(tiny_model("qwen3_moe", experts_implementation="eager", **overrides)).float()
    model = import_moe(ref, lora_api.expert_config(MoEConfig(router="native"), lora))
    lora_api.apply_lora(model, lora)
    lora_api.init_adapters(model, 0, lora_api.held_experts(model))
    if lora.base_dtype == "nf4":
        lora_api.quantize_base(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name) and "lora_b" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def float_reference(model, lora):
    """The same model built with the run's dtype for its base (the same seeds, hence the same adapters), its base
    weights set to ``model``'s dequantised NF4 ones: the reference. (Not a deepcopy: torchao 0.18 re-quantises an
    NF4Tensor's deepcopy with its default 256 scale blocks, which small weights do not divide.)"""
    ref = qlora_model(replace(lora, base_dtype="run"))
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in nf4_params(model):
            ref_params[name].copy_(p.get_original_weight())
    return ref


def nf4_params(model):
    return [(name, p) for name, p in model.named_parameters() if nf4.is_nf4(p)]


def loss_and_grads(model, ids):
    with collect_aux_losses():
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def test_the_forward_equals_the_dequantised_float_model():
    model = qlora_model(QLORA)
    stored = dict(nf4_params(model))
    assert any(".self_attn.q_proj.weight" in n for n in stored) and any(".mlp.gate_proj.weight" in n for n in stored)
    assert any(".experts.experts.5.w_gate" in n for n in stored)
    assert any(".experts.experts.0.w_out" in n for n in stored)
    ref = float_reference(model, QLORA)
    assert not nf4_params(ref)
    ids = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(2))  # every expert gets rows
    logits, loss, grads = loss_and_grads(model, ids)
    ref_logits, ref_loss, ref_grads = loss_and_grads(ref, ids)
    assert logits.abs().max() > 0.1
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and all(is_adapter(n) for n in grads)
    for name, grad in grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)
    for name, p in stored.items():
        assert not p.requires_grad and p.grad is None, name


def test_the_nf4_base_is_close_to_the_float_base():
    """The dequantised base is the float base up to NF4's rounding: within half the widest gap between NF4
    levels (about 0.15) of each block's absmax."""
    lora = replace(QLORA, base_dtype="run")
    plain = qlora_model(lora)
    quantized = qlora_model(QLORA)
    plain_params = dict(plain.named_parameters())
    for name, p in nf4_params(quantized):
        want_B64 = plain_params[name].detach().reshape(-1, nf4.BLOCK_SIZE)
        err_B64 = (p.get_original_weight() - plain_params[name]).reshape(-1, nf4.BLOCK_SIZE).abs()
        assert (err_B64 <= 0.16 * want_B64.abs().amax(dim=1, keepdim=True)).all(), name


def test_the_stored_base_is_about_4_bits_a_weight():
    """At a size where NF4's per-tensor constants are small (hidden 128, experts of 64, head_dim 32): the NF4
    weights' stored bytes (codes, int8 block scales, their float32 factors, mean and 16 levels) over their count."""
    overrides = dict(hidden_size=128, moe_intermediate_size=64, intermediate_size=128, head_dim=32)
    model = qlora_model(QLORA, **overrides)
    stored = nf4_params(model)
    weights = sum(p.numel() for _, p in stored)
    bits = 8 * sum(nf4.stored_bytes(p) for _, p in stored) / weights
    assert 4.0 < bits <= 4.5, bits
    experts = [p for name, p in stored if ".experts.experts." in name]
    assert len(experts) == 3 * sum(len(m.experts) for m in model.modules() if isinstance(m, MoELayer))


def test_an_nf4_bank_runs_the_per_expert_loop(monkeypatch):
    model = qlora_model(QLORA)
    bank = next(m for m in model.modules() if isinstance(m, MoELayer)).experts
    bank.config.expert_compute = "grouped_mm"
    called = []
    monkeypatch.setattr(type(bank), "_loop", lambda self, rows, counts, sizes=None: called.append(1) or rows)
    rows_RD = torch.randn(4, bank.config.dim)
    bank(rows_RD, torch.tensor([4] + [0] * (len(bank) - 1)))
    assert called


def test_nf4_without_torchao_is_one_line(monkeypatch):
    monkeypatch.setattr(nf4, "backend_available", lambda: False)
    with pytest.raises(ValueError, match=r"lora.base_dtype \('nf4'\) needs torchao.*pip install torchao==") as err:
        lora_api.LoraConfig(base_dtype="nf4")
    assert "\n" not in str(err.value)


def test_a_weight_no_multiple_of_the_block_is_one_line():
    linear = nn.Linear(5, 3)
    with pytest.raises(ValueError, match=r"x.weight \(3, 5\) has 15 weights, not a multiple of the NF4 block \(64\)"):
        nf4.quantize([(linear, "weight", "x.weight")])
    assert not nf4.is_nf4(linear.weight)


def test_an_nf4_base_with_expert_fsdp_is_one_line():
    """NF4 experts are not FSDP-sharded over their expert-dp group: a run file asking for both fails at load."""
    with pytest.raises(ValueError, match=r"base_dtype \('nf4'\) with parallel.expert_sharding \('fsdp'\)") as err:
        load_config(None, ["lora.enabled=true", "lora.base_dtype='nf4'", "parallel.expert_sharding='fsdp'"])
    assert "\n" not in str(err.value)
