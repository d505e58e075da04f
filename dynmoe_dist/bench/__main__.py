"""`python -m dynmoe_dist.bench NAME [options]`: benchmarks that print one JSON object each."""

import importlib
import sys

BENCHMARKS = {
    "layer": "dynmoe_dist.bench.layer",
    "ep": "dynmoe_dist.bench.ep",
    "adapt": "dynmoe_dist.bench.adapt",
    "memory": "dynmoe_dist.bench.memory",
    "gpu": "dynmoe_dist.bench.gpu",
    "scale": "dynmoe_dist.bench.scale",
    "hf": "dynmoe_dist.bench.hf",
    "generate": "dynmoe_dist.bench.generate",
    "checkpoint": "dynmoe_dist.bench.checkpoint",
    "data": "dynmoe_dist.bench.data",
    "import": "dynmoe_dist.bench.import_load",
    "hf-moe": "dynmoe_dist.bench.hf_moe",
    "lora": "dynmoe_dist.bench.lora",
}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m dynmoe_dist.bench {{{','.join(BENCHMARKS)}}} [options]")
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
