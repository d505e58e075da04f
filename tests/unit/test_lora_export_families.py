"""The unmerged LoRA export (models/lora_export.py ``save_peft_adapter``) of every imported family: the tiny random
model of each (tests/hf_tiny.py MOE_FAMILIES), float32, native routing, trained two AdamW steps with adapters on
the attention, the routed experts, and the shared experts and dense MLPs where it has them; written as a PEFT
adapter directory, PEFT 0.21's ``PeftModel.from_pretrained`` loads it onto the base and its logits are the run's
(1e-5), where the base's own differ (the adapters matter). gpt-oss checks the interleaved gate / up rows of its
fused experts, DeepSeek-V3 / GLM-4.5 / Mistral 4 the shared experts and the dense first layer, Qwen2-MoE and
Qwen3.5-MoE the shared expert.
"""

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import MOE_FAMILIES, randomize, tiny_model  # noqa: E402

from dynmoe_dist.models.hf.families import causal_lm_class  # noqa: E402
from dynmoe_dist.models.hf.moe_import import import_moe  # noqa: E402
from dynmoe_dist.models.lora import (  # noqa: E402
    LoraConfig,
    apply_lora,
    dense_targets,
    expert_config,
    held_experts,
    init_adapters,
)
from dynmoe_dist.models.lora_export import save_peft_adapter  # noqa: E402
from dynmoe_dist.moe import MoEConfig  # noqa: E402
from dynmoe_dist.moe.aux_collector import collect_aux_losses  # noqa: E402
from dynmoe_dist.parallel.grads import fill_missing_grads  # noqa: E402

IDS = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(7))


def targets_of(model):
    """Every target the family has (a dense MLP where a decoder layer is dense, shared experts where it has them)."""
    found = dense_targets(model)
    return ("attention", "routed_experts", *(target for target in ("dense_mlp", "shared_experts") if found[target]))


def logits(model):
    with torch.no_grad(), collect_aux_losses():
        return model.eval()(input_ids=IDS).logits


def trained(ref, lora):
    """The run's model: ``ref`` imported with native routing and ``lora``, two AdamW steps (B leaves zero)."""
    model = import_moe(copy.deepcopy(ref), expert_config(MoEConfig(router="native"), lora))
    apply_lora(model, lora)
    init_adapters(model, 0, held_experts(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(2, 64, (2, 7), generator=g)
        with collect_aux_losses():
            model.train()(input_ids=ids, labels=ids).loss.backward()
        fill_missing_grads(trainable)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("family", MOE_FAMILIES)  # about a second each: all in the default suite
def test_peft_loads_the_adapter_of_every_family(family, tmp_path):
    from peft import PeftModel

    ref = randomize(tiny_model(family, experts_implementation="eager")).float()
    ref.save_pretrained(str(tmp_path / "base"))
    probe = import_moe(copy.deepcopy(ref), MoEConfig(router="native"))
    lora = LoraConfig(enabled=True, rank=2, alpha=4.0, targets=targets_of(probe))
    model = trained(ref, lora)
    expected = logits(model)

    out = save_peft_adapter(model, lora, str(tmp_path / "base"), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(config["target_parameters"])
    base = causal_lm_class(ref.config).from_pretrained(str(tmp_path / "base"), experts_implementation="eager")
    assert (logits(base) - expected).abs().max() > 1e-3  # the adapters matter
    loaded = PeftModel.from_pretrained(base, str(out))
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=1e-5)
