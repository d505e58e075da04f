"""A LoRA run out (models/lora_export.py), on the tiny Qwen3-MoE trained three AdamW steps with adapters on the
attention, the dense first MLP and every routed expert, float32: merged and written in the stock format, plain
transformers loads it and its logits are the run's (1e-6); as a PEFT adapter directory, PEFT's own
``PeftModel.from_pretrained`` loads it onto the base and its logits are the run's (1e-5), its keys and shapes
exactly PEFT's for the same config on the same base; a pruned run's unmerged export is refused in one line and
the merged model is written instead. And every imported family (tests/hf_tiny.py MOE_FAMILIES), float32, trained
two steps with adapters on the attention, the routed experts, and the shared experts and dense MLPs where it has
them: PEFT loads its adapter with the run's logits (1e-5). gpt-oss checks the interleaved gate / up rows of its
fused experts, DeepSeek-V3 / GLM-4.5 / Mistral 4 the shared experts and the dense first layer, Qwen2-MoE and
Qwen3.5-MoE the shared expert.
"""

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, NUM_EXPERTS, randomize, tiny_model  # noqa: E402

from dynmoe_dist.models.hf.families import causal_lm_class  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.models.hf.stock_layout import save_stock  # noqa: E402
from dynmoe_dist.models.lora import (  # noqa: E402
    LoraConfig,
    apply_lora,
    dense_targets,
    expert_config,
    held_experts,
    init_adapters,
)
from dynmoe_dist.models.lora_export import (  # noqa: E402
    export_lora,
    merge_adapters,
    peft_config,
    save_peft_adapter,
)
from dynmoe_dist.moe import MoEConfig  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.moe.layer import find_moe_layers, rebuild_experts  # noqa: E402
from dynmoe_dist.parallel.grads import fill_missing_grads  # noqa: E402

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, targets=("attention", "dense_mlp", "routed_experts"))
IDS = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(7))


def load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), experts_implementation="eager", dtype="auto").eval()


def logits(model):
    with torch.no_grad(), collect_aux_losses():
        return model(input_ids=IDS).logits


def assert_matches(got, expected, dtype):
    """float64: exact (1e-12); float32: within 1e-6 of the logits' scale (W + (alpha/r) B A rounds once where
    the run adds x A^T B^T to x W^T: a few float32 ulps of the largest logit)."""
    atol = 1e-12 if dtype == torch.float64 else 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def adapted(ref, lora, steps):
    """The run's model: ``ref`` imported with native routing and ``lora``, ``steps`` AdamW steps (B leaves zero:
    every adapter changes the logits); in eval mode."""
    model = import_moe(copy.deepcopy(ref), expert_config(MoEConfig(router="native"), lora))
    apply_lora(model, lora)
    init_adapters(model, 0, held_experts(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(2, 64, (2, 7), generator=g)
        with collect_aux_losses():
            model.train()(input_ids=ids, labels=ids).loss.backward()
        fill_missing_grads(trainable)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


def trained(directory, dtype, lora):
    """(base directory, the run's model after three AdamW steps with ``lora``, its logits)."""
    ref = randomize(tiny_model("qwen3_moe", experts_implementation="eager")).to(dtype)
    base = directory / "base"
    ref.save_pretrained(str(base))
    model = adapted(ref, lora, 3)
    return base, model, logits(model)


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32", "float64"])
def run(tmp_path, request):
    return trained(tmp_path, request.param, LORA)


def test_merged_export_loads_in_plain_transformers(run, tmp_path):
    base, model, expected = run
    assert (expected - logits(load(base))).abs().max() > 1e-3  # the adapters matter
    merge_adapters(model)
    assert not [name for name, _ in model.named_parameters() if "lora" in name]
    assert_matches(logits(model), expected, expected.dtype)
    save_stock(model, tmp_path / "merged")
    assert_matches(logits(load(tmp_path / "merged")), expected, expected.dtype)


def test_peft_adapter_loads_onto_the_base(run, tmp_path):
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file

    base, model, expected = run
    out = save_peft_adapter(model, LORA, str(base), tmp_path / "adapter")
    written = load_file(str(out / "adapter_model.safetensors"))
    reference = get_peft_model_state_dict(get_peft_model(load(base), peft_config(model, LORA, str(base))))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in reference.items()}
    assert any(k.endswith("layers.1.mlp.experts.base_layer.lora_A.weight") for k in written)  # gate_up_proj
    assert any(k.endswith("layers.2.mlp.experts.lora_B.weight") for k in written)  # down_proj
    assert any(k.endswith("layers.0.self_attn.q_proj.lora_A.weight") for k in written)
    assert any(k.endswith("layers.0.mlp.gate_proj.lora_B.weight") for k in written)  # the dense first MLP's weight
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["r"] == 4 and config["lora_alpha"] == 8.0
    loaded = PeftModel.from_pretrained(load(base), str(out)).eval()
    atol = 1e-12 if expected.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=atol)


def _prune(model, keep):
    """Keep only the experts ``keep`` (and their router rows) in every MoE layer, as a prune leaves them."""
    for _, layer in find_moe_layers(model):
        rows = layer.router.weight.detach()[keep].clone()
        rebuild_experts(layer, len(keep), [dict(layer.experts.experts[e].named_parameters()) for e in keep])
        with torch.no_grad():
            layer.router.weight.copy_(rows)


def test_a_pruned_run_is_refused_unmerged_and_written_merged(run, tmp_path):
    base, model, _ = run
    _prune(model, [0, 2, 3, 5])
    expected = logits(model)
    with pytest.raises(ValueError, match=r"unchanged base.*hold \[4, 4\] experts where the base has 6") as err:
        save_peft_adapter(model, LORA, str(base), tmp_path / "refused")
    assert "\n" not in str(err.value)
    written, note = export_lora(model, LORA, str(base), tmp_path / "out", unmerged=True, save_merged=save_stock)
    assert note is not None and note.startswith(str(err.value)) and "merged" in note and "\n" not in note
    assert not (written / "adapter_config.json").exists()
    merged = load(written)
    assert merged.config.num_experts == 4 and NUM_EXPERTS == 6
    assert_matches(logits(merged), expected, expected.dtype)


def test_export_lora_writes_the_adapter_when_asked_and_it_applies(run, tmp_path):
    base, model, _ = run
    written, note = export_lora(model, LORA, str(base), tmp_path / "out", unmerged=True, save_merged=save_stock)
    assert note is None and (written / "adapter_model.safetensors").is_file()
    assert not (written / "config.json").exists()  # the adapter alone, not the model


# -- every family -----------------------------------------------------------------------------------------
def targets_of(model):
    """Every target the family has (a dense MLP where a decoder layer is dense, shared experts where it has them)."""
    found = dense_targets(model)
    return ("attention", "routed_experts", *(target for target in ("dense_mlp", "shared_experts") if found[target]))


@pytest.mark.parametrize("family", MOE_FAMILIES)  # about a second each: all in the default suite
def test_peft_loads_the_adapter_of_every_family(family, tmp_path):
    from peft import PeftModel

    ref = randomize(tiny_model(family, experts_implementation="eager")).float()
    ref.save_pretrained(str(tmp_path / "base"))
    probe = import_moe(copy.deepcopy(ref), MoEConfig(router="native"))
    lora = LoraConfig(enabled=True, rank=2, alpha=4.0, targets=targets_of(probe))
    model = adapted(ref, lora, 2)
    expected = logits(model)

    out = save_peft_adapter(model, lora, str(tmp_path / "base"), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(config["target_parameters"])
    base = causal_lm_class(ref.config).from_pretrained(str(tmp_path / "base"), experts_implementation="eager")
    assert (logits(base) - expected).abs().max() > 1e-3  # the adapters matter
    loaded = PeftModel.from_pretrained(base, str(out))
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=1e-5)
