"""A Qwen3-MoE checkpoint of any size, written one tensor at a time, for the benchmarks that import one
(bench/import_load.py, bench/hf_moe.py).

The directory is what save_pretrained writes: config.json (transformers' ``Qwen3MoeConfig.save_pretrained``),
the weights in safetensors shards ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``,
with save_pretrained's keys: per-expert ``model.layers.i.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``,
the router ``model.layers.i.mlp.gate.weight`` and every other key as transformers names it.

Why not save_pretrained itself: it needs the whole model in memory, and these checkpoints are meant to be
larger than a rank may hold. A shard's header (each key's dtype, shape and byte range) follows from the
shapes alone, so it is written first and the tensors after it, each drawn from its own seeded generator and
dropped once written: the writer never holds more than one tensor. Values are N(0, 0.02) and the norms 1;
they do not matter here, the layout and the sizes do. Everything is float32, the dtype runs train in, so a
rank's reads are the size of what it holds.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..models.hf.safetensors_reader import INDEX_FILE

Spec = Tuple[str, Tuple[int, ...]]
BYTES_PER_VALUE = 4  # float32
INIT_STD = 0.02


@dataclass(frozen=True)
class Qwen3MoeShape:
    """The Qwen3MoeConfig fields the benchmarks choose (no shared experts, every layer sparse, untied head)."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    moe_ffn: int
    vocab: int
    heads: int
    kv_heads: int
    """Key/value heads; the head dimension is hidden / heads (Qwen3MoeConfig has no head_dim field)."""

    def hf_config(self) -> Any:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.moe_ffn,  # read only by mlp_only_layers, of which there are none
            moe_intermediate_size=self.moe_ffn,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            dtype="float32",
        )


def is_expert_key(key: str) -> bool:
    return ".mlp.experts." in key


def tensor_specs(config: Any) -> List[Spec]:
    """(key, shape) of every tensor save_pretrained writes for a Qwen3-MoE of ``config``, in the model's
    order (models.hf.imported.stock_tensor_specs of the model built on the meta device: no memory)."""
    from transformers import Qwen3MoeForCausalLM

    from ..models.hf.imported import stock_tensor_specs

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    return stock_tensor_specs(model)


def nbytes(shape: Tuple[int, ...]) -> int:
    return math.prod(shape) * BYTES_PER_VALUE


def plan_shards(specs: List[Spec], max_shard_bytes: int) -> List[List[Spec]]:
    """Consecutive tensors into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: List[List[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + nbytes(spec[1]) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes(spec[1])
    return shards


def header(specs: List[Spec]) -> bytes:
    """The safetensors header of a file holding ``specs`` back to back: 8-byte little-endian length, then the
    JSON, padded with spaces to a multiple of 8 so the data that follows stays aligned."""
    entries: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in specs:
        entries[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape)]}
        offset += nbytes(shape)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def values(key: str, shape: Tuple[int, ...], seed: int) -> torch.Tensor:
    """The tensor's values: ones for a norm (a trainable start for bench hf-moe), else N(0, INIT_STD)."""
    if key.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul_(INIT_STD)


def write_shard(path: Path, specs: List[Spec], seeds: Iterator[int]) -> None:
    with open(path, "wb") as f:
        f.write(header(specs))
        for key, shape in specs:
            # numpy's buffer is the tensor's memory: written without another copy
            f.write(values(key, shape, next(seeds)).numpy().data)


def write_checkpoint(directory: Path, shape: Qwen3MoeShape, *, max_shard_bytes: int, seed: int = 0) -> Dict:
    """Write the checkpoint into ``directory`` (made if missing); returns what it holds."""
    directory.mkdir(parents=True, exist_ok=True)
    config = shape.hf_config()
    config.save_pretrained(str(directory))
    specs = tensor_specs(config)
    shards = plan_shards(specs, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    seeds = iter(range(seed * len(specs), (seed + 1) * len(specs)))  # one generator per tensor
    for name, shard in zip(names, shards):
        write_shard(directory / name, shard, seeds)
    weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
    total = sum(nbytes(s) for _, s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return describe(shape, specs, len(shards))


def describe(shape: Qwen3MoeShape, specs: List[Spec], num_files: int) -> Dict:
    """The checkpoint's shape, files and the dense / expert split, for a benchmark's JSON."""
    experts = sum(math.prod(s) for key, s in specs if is_expert_key(key))
    dense = sum(math.prod(s) for key, s in specs if not is_expert_key(key))
    mib = BYTES_PER_VALUE / 2**20
    return {
        "family": "Qwen3-MoE",  # the benchmarks write this one family (Qwen3MoeConfig)
        **asdict(shape),
        "dtype": "float32",
        "num_tensors": len(specs),
        "num_files": num_files,
        "total_mib": round((dense + experts) * mib, 1),
        "dense_parameters": dense,
        "expert_parameters": experts,
        "dense_mib": round(dense * mib, 1),
        "expert_mib": round(experts * mib, 1),
        "expert_fraction": round(experts / (dense + experts), 4),
    }
