"""`dynmoe-train` / `python -m dynmoe_dist.train`: run a training job from a TOML file plus overrides.

Works as a single process, under `torchrun --nproc-per-node N`, and inside Ray Train workers.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..config import RunConfig, load_config, options_help


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynmoe-train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a DynMoE model (single process, torchrun, or Ray workers).",
        epilog="Every option below can be set in the TOML file (as [section] key = value) or with\n"
               "--set section.key=value:\n\n" + options_help())
    p.add_argument("--config", help="TOML run file (e.g. launcher/configs/demo.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one option (repeatable)")
    p.add_argument("--out-dir", help="shortcut for --set output.out_dir=DIR")
    p.add_argument("--resume", help="shortcut for --set output.resume=auto|PATH")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    return p


def resolve(args) -> "RunConfig":
    overrides = list(args.overrides)
    if args.out_dir:
        overrides.append(f"output.out_dir={args.out_dir!r}")
    if args.resume:
        overrides.append(f"output.resume={args.resume!r}")
    return load_config(args.config, overrides)


def summary(final: dict, out_dir: str) -> str:
    lines = [f"test accuracy {final['test_accuracy']:.4f}  test loss {final['test_loss']:.4f}  "
             f"steps {final['step']}  wall {final['wall_s']:.1f}s",
             f"experts per MoE layer at the end: {final.get('num_experts')}",
             f"metrics: {out_dir}/metrics.jsonl"]
    if final.get("report"):
        lines.append(f"report: {final['report']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = resolve(args)
    except ValueError as err:
        print(f"dynmoe-train: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_toml())
        return 0
    from .run import run  # heavy imports only when actually training
    final = run(config)
    if final.get("rank0", True) and "test_accuracy" in final:
        print(summary(final, config.output.out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
