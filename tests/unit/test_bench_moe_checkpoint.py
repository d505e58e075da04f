"""The streamed Qwen3-MoE checkpoint of the import benchmarks (bench/moe_checkpoint.py): the same keys, shapes
and dtypes as transformers' save_pretrained of that config, split into shards that the index names, with
seeded values that transformers loads."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dynmoe_dist.bench import moe_checkpoint as gen  # noqa: E402
from dynmoe_dist.models.hf.safetensors_reader import INDEX_FILE, read_all  # noqa: E402

TINY = gen.Qwen3MoeShape(num_layers=2, num_experts=4, top_k=2, hidden=16, moe_ffn=8, vocab=32, heads=2, kv_heads=1)


def test_plan_shards_cuts_before_the_tensor_that_would_overflow():
    # float32: 4 bytes a value; sizes 16, 16, 48, 16 bytes with at most 32 per shard
    specs = [("a", (4,)), ("b", (2, 2)), ("c", (12,)), ("d", (4,))]
    shards = gen.plan_shards(specs, max_shard_bytes=32)
    assert [[key for key, _ in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]  # c alone: too large


def test_header_is_aligned_and_describes_the_tensors_back_to_back():
    raw = gen.header([("x", (3,)), ("y", (2, 2))])
    length = int.from_bytes(raw[:8], "little")
    assert length % 8 == 0 and len(raw) == 8 + length
    entries = json.loads(raw[8:])
    assert entries["x"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert entries["y"]["data_offsets"] == [12, 28]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    summary = gen.write_checkpoint(directory, TINY, max_shard_bytes=4096, seed=3)
    return directory, summary


def test_the_files_hold_what_save_pretrained_writes(written, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    directory, summary = written
    Qwen3MoeForCausalLM(TINY.hf_config()).save_pretrained(tmp_path)
    want = {key: (t.shape, t.dtype) for key, t in read_all(tmp_path).items()}
    have = read_all(directory)
    assert {key: (t.shape, t.dtype) for key, t in have.items()} == want
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in have and "model.layers.0.mlp.gate.weight" in have
    expert_values = sum(t.numel() for key, t in have.items() if ".mlp.experts." in key)
    assert summary["expert_parameters"] == expert_values == 2 * 4 * 3 * 16 * 8
    assert summary["dense_parameters"] == sum(t.numel() for t in have.values()) - expert_values


def test_the_index_names_every_key_across_several_shards(written):
    directory, summary = written
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) == summary["num_files"] > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for name in files:
        assert (directory / name).stat().st_size <= 4096 + 4096  # a shard: at most 4096 bytes of data + header


def test_values_are_seeded_per_tensor_and_norms_are_one(written, tmp_path):
    directory, _ = written
    first = read_all(directory)
    gen.write_checkpoint(tmp_path, TINY, max_shard_bytes=1 << 20, seed=3)  # one shard this time
    again = read_all(tmp_path)
    assert all(torch.equal(first[key], again[key]) for key in first)  # same seed, other shards: same values
    assert torch.equal(first["model.norm.weight"], torch.ones(16))
    router = first["model.layers.0.mlp.gate.weight"]
    assert 0.005 < float(router.std()) < 0.05  # N(0, 0.02)


def test_transformers_loads_the_checkpoint(written):
    from transformers import AutoModelForCausalLM

    directory, _ = written
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    files = read_all(directory)
    # transformers fuses the per-expert keys on load: gate rows 0:F of gate_up_proj[e]
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    torch.testing.assert_close(fused[2, :8], files["model.layers.1.mlp.experts.2.gate_proj.weight"], rtol=0, atol=0)
    assert model.dtype == torch.float32
