"""`python -m dynmoe_dist.bench import [--ranks 1,2,4] [--tiny] [--keep DIR] [--out FILE]`: host memory and
time of importing a transformers MoE checkpoint on N ranks, each reading only what it holds.

A Qwen3-MoE checkpoint (bench/moe_checkpoint.py: 8 layers of 64 experts, hidden 1024, moe_intermediate_size
512, vocabulary 32768, 16 heads with 4 key/value heads, untied head; float32; 3.4 GiB of which 90% experts)
is written tensor by tensor as save_pretrained lays it out, in shards of --shard-mib with an index, into a
temporary directory (removed afterwards unless --keep DIR). Then on N gloo ranks, every rank a fresh spawned
process, each rank builds the run as training does: ``build_model`` (the meta device) and ``build_parts``
with ``parallel.dense_sharding = "fsdp"`` and expert parallelism over the world, which places the experts,
shards the dense weights and reads this rank's experts and FSDP rows from the files.

Per rank: ``peak_mib``, the peak resident memory of building above the resident memory just before it
(VmHWM after resetting it: bench/measure.py, with a fixed mmap threshold); ``share_mib``, what the rank
holds afterwards (its FSDP rows of every dense tensor + its experts, counted from its tensors); the time
(``load_s``, of which ``build_model_s`` is the model's construction on the meta device, before any read);
and whether it meets the target peak <= 1.2 x share + 200 MiB (``over_target_mib`` says by how much not).
Before the measured build, every rank builds a tiny checkpoint the same way (imports, gloo, FSDP's first
calls are not the figure). Afterwards it checks that some of its tensors (dense rows, a router, the first
and last local expert of two layers) equal the files', so a rank cannot pass by reading nothing. The files
were just written, so they are read from the page cache.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple, cast

import torch

from ..config import RunConfig, from_dict, model_source_defaults, resolve_num_layers
from .checkpoint import parse_ranks
from .measure import emit_json, machine_info, measured_call, memory_process_env
from .moe_checkpoint import Qwen3MoeShape, write_checkpoint

MIB = 2**20
TARGET_SHARE, TARGET_CONSTANT_MIB = 1.2, 200.0
FULL = Qwen3MoeShape(num_layers=8, num_experts=64, top_k=8, hidden=1024, moe_ffn=512, vocab=32768, heads=16, kv_heads=4)
TINY = Qwen3MoeShape(num_layers=2, num_experts=8, top_k=2, hidden=64, moe_ffn=32, vocab=256, heads=4, kv_heads=2)
MEMORY_METHOD = (
    "every rank is a fresh spawned process with MALLOC_MMAP_THRESHOLD_=131072 (each tensor above 128 KiB is "
    "its own mapping, so freed memory leaves the resident set); a warm-up build of a tiny checkpoint pays the "
    "one-time costs; then gc, malloc_trim, VmRSS as the baseline, the high-water mark reset "
    "(5 > /proc/self/clear_refs), build_model + build_parts, and VmHWM - baseline in MiB. File pages a rank "
    "has mapped and touched count as resident too (safetensors memory-maps the files)"
)


def run_config(directory: Path) -> RunConfig:
    """The run on the checkpoint: its own routing, expert count and MoE blocks from config.json (as
    load_config fills them), dense weights sharded with FSDP, experts over the whole world (ep_size 0)."""
    data: Dict = {"model": {"source": "hf", "path": str(directory)}, "parallel": {"dense_sharding": "fsdp"}}
    model_source_defaults(data)
    config = from_dict(data)
    resolve_num_layers(config.model)
    return config


def build_run(directory: Path, vocab: int) -> Tuple[Any, float]:
    """build_model + build_parts, as training does: the model on the meta device, then this rank's share read;
    returns the parts and build_model's seconds (the rest of the time is build_parts', the reading in it)."""
    from ..models.build import build_model
    from ..tasks.base import ModelNeeds
    from ..train.parts import build_parts

    config = run_config(directory)
    started = time.perf_counter()
    source = build_model(config.model, config.moe, ModelNeeds("causal-lm", vocab))
    build_model_s = time.perf_counter() - started
    with warnings.catch_warnings():  # one rank: FSDP has nothing to shard, and says so
        warnings.simplefilter("ignore", UserWarning)
        return build_parts(config, source), build_model_s


def _local_bytes(tensors: List[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (an FSDP shard's local rows)."""
    from ..parallel.fsdp import local

    return sum(local(t).numel() * t.element_size() for t in tensors)


def held_bytes(parts) -> Tuple[int, int]:
    """(dense, expert) bytes this rank holds: its FSDP rows of the dense tensors (buffers too) and its experts."""
    experts = [p for shard in parts.experts.shards for p in shard.layer.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    unique = {id(t): t for t in [*parts.model.parameters(), *parts.model.buffers()]}
    return _local_bytes([t for key, t in unique.items() if key not in expert_ids]), _local_bytes(experts)


def _dense_matches(p: torch.Tensor, checkpoint, name: str) -> bool:
    from ..parallel.fsdp import is_sharded, local, local_rows

    if is_sharded(p):  # an FSDP shard (a DTensor): this rank's rows of the file's tensor
        start, stop = local_rows(cast(Any, p))
        return torch.equal(local(p), checkpoint.rows(name, start, stop))
    return torch.equal(p, checkpoint.rows(name, 0, p.shape[0]))


def check_values(parts, directory: Path) -> Tuple[int, bool]:
    """(tensors checked, all equal to the files'): the first, a middle and the last dense tensor and the first
    router (this rank's rows), and the first and last local expert of the first and last MoE layer."""
    from ..models.hf.imported import ImportedCheckpoint, dense_tensors

    hf_model = parts.model.transformers_model()
    checkpoint = ImportedCheckpoint(directory, hf_model)
    tensors = dict(hf_model.named_parameters()) | dict(hf_model.named_buffers())
    names = [name for name, _ in dense_tensors(hf_model)]
    router = next(name for name in names if name.endswith("moe.router.weight"))
    checks = [_dense_matches(tensors[n], checkpoint, n) for n in (names[0], names[len(names) // 2], names[-1], router)]
    shards = parts.experts.shards
    for shard in {id(s): s for s in (shards[0], shards[-1])}.values():
        for slot in sorted({0, len(shard.local_experts) - 1}):
            want = checkpoint.expert(shard.index, shard.local_experts[slot])
            module = shard.layer.experts.experts[slot]
            checks += [torch.equal(p, want[name]) for name, p in module.named_parameters()]
    return len(checks), all(checks)


def rank_case(spec: Dict) -> Dict:
    """One rank: a warm-up build of the tiny checkpoint, then the measured build of the real one."""
    from ..parallel.groups import barrier

    torch.set_num_threads(1)
    groups = build_run(Path(spec["warm_up"]), TINY.vocab)[0].groups
    barrier(groups, "bench import")
    held: List = []
    peak, seconds = measured_call(lambda: held.append(build_run(Path(spec["directory"]), spec["vocab"])))
    parts, build_model_s = held[0]
    dense, experts = held_bytes(parts)
    checked, match = check_values(parts, Path(spec["directory"]))
    return {
        "rank": groups.rank,
        "peak_mib": peak,
        "dense_mib": dense / MIB,
        "expert_mib": experts / MIB,
        "load_s": seconds,
        "build_model_s": build_model_s,
        "checked_tensors": checked,
        "values_match": match,
    }


def target_mib(share_mib: float) -> float:
    return TARGET_SHARE * share_mib + TARGET_CONSTANT_MIB


def rank_row(r: Dict) -> Dict:
    """One rank's figures against the target, rounded."""
    share = r["dense_mib"] + r["expert_mib"]
    target = target_mib(share)
    return {
        "rank": r["rank"],
        "peak_mib": r["peak_mib"],
        "dense_mib": round(r["dense_mib"], 2),
        "expert_mib": round(r["expert_mib"], 2),
        "share_mib": round(share, 2),
        "target_mib": round(target, 2),
        "peak_over_share": round(r["peak_mib"] / share, 3),
        "meets_target": r["peak_mib"] <= target,
        "over_target_mib": round(max(0.0, r["peak_mib"] - target), 2),
        "load_s": round(r["load_s"], 3),
        "build_model_s": round(r["build_model_s"], 3),
        "checked_tensors": r["checked_tensors"],
        "values_match": r["values_match"],
    }


def summarize(world: int, per_rank: List[Dict]) -> Dict:
    rows = [rank_row(r) for r in per_rank]
    return {
        "ranks": world,
        "load_s": max(r["load_s"] for r in rows),  # the slowest rank's
        "build_model_s": max(r["build_model_s"] for r in rows),
        "max_peak_mib": max(r["peak_mib"] for r in rows),
        "meets_target": all(r["meets_target"] for r in rows),
        "missed_by_mib": max(r["over_target_mib"] for r in rows),
        "values_match": all(r["values_match"] for r in rows),
        "per_rank": rows,
    }


def run_case(world: int, directory: Path, warm_up: Path, vocab: int, timeout_s: float) -> Dict:
    from ..parallel.simulate import run_simulated

    spec = {"directory": str(directory), "warm_up": str(warm_up), "vocab": vocab}
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return summarize(world, run_simulated(rank_case, world, args=(spec,), timeout_s=timeout_s, env=env))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench import",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", default="1,2,4", help="world sizes to measure, comma-separated (default 1,2,4)")
    p.add_argument("--tiny", action="store_true", help="a tiny checkpoint (2 layers of 8 experts): a smoke run")
    p.add_argument("--shard-mib", type=float, default=512, help="largest safetensors shard, MiB (default 512)")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint into DIR and keep it")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--timeout-s", type=float, default=1800)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    ranks = parse_ranks(args.ranks)
    shape = TINY if args.tiny else FULL
    root = Path(tempfile.mkdtemp(prefix="bench_import_"))
    directory = Path(args.keep) if args.keep else root / "moe"
    try:
        started = time.perf_counter()
        described = write_checkpoint(directory, shape, max_shard_bytes=int(args.shard_mib * MIB))
        generate_s = time.perf_counter() - started
        # the warm-up's shards are small too, so it goes through the same index path
        write_checkpoint(root / "warm_up", TINY, max_shard_bytes=64 * 1024, seed=1)
        with memory_process_env():  # the spawned ranks inherit it
            cases = [run_case(world, directory, root / "warm_up", shape.vocab, args.timeout_s) for world in ranks]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "import",
        "checkpoint": {**described, "generate_s": round(generate_s, 1), "kept": args.keep},
        "target": f"peak host memory of loading per rank <= {TARGET_SHARE} x (its dense rows + its experts) "
        f"+ {TARGET_CONSTANT_MIB:g} MiB",
        "meets_target": all(c["meets_target"] for c in cases),
        "values_match": all(c["values_match"] for c in cases),
        "cases": cases,
        "memory_method": MEMORY_METHOD,
        "machine": machine_info(1),
    }
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
