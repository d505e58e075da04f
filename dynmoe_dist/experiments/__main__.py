"""`python -m dynmoe_dist.experiments SUBCOMMAND [options]`.

    compare    top-k vs DynMoE under the same budget: results.md, results.json, comparison.png
    losses     per-loss router gradients, k over time and expert growth of each DynMoE loss set
    baseline   frozen-MiniLM + logistic regression on minilm-sentiment (one JSON line)
    drift      how far an upcycled run's experts moved from the pre-trained MLP and from one another
    lm-eval    lm-evaluation-harness on an exported model: held-out perplexity and sentiment multiple choice
    pretrain-moe  pre-train a small Qwen3-MoE on the installed packages' docstrings; a stock checkpoint
    moe-finetune  finetune it on Rotten Tomatoes three ways (native, top-any, top-any + pruning): does it pay?
    moe-frontier  held-out loss against expert FLOPs: native top-1/2/3, top-p, top-any at five budgets
    moe-lora      LoRA (ranks 8, 32) and QLoRA against the full finetune: held-out loss and peak memory

`python -m dynmoe_dist.experiments SUBCOMMAND --help` lists a subcommand's options.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

PROG = "python -m dynmoe_dist.experiments"


def _compare(argv):
    from .compare import main

    main(argv, prog=f"{PROG} compare")


def _losses(argv):
    from .losses import main

    main(argv, prog=f"{PROG} losses")


def _baseline(argv):
    from .baseline import main

    main(argv, prog=f"{PROG} baseline")


def _drift(argv):
    from .drift import main

    main(argv, prog=f"{PROG} drift")


def _lm_eval(argv):
    from .lmeval import main

    main(argv, prog=f"{PROG} lm-eval")


def _pretrain_moe(argv):
    from .pretrain_moe import main

    main(argv, prog=f"{PROG} pretrain-moe")


def _moe_finetune(argv):
    from .moe_finetune import main

    main(argv, prog=f"{PROG} moe-finetune")


def _moe_frontier(argv):
    from .moe_frontier import main

    main(argv, prog=f"{PROG} moe-frontier")


def _moe_lora(argv):
    from .moe_lora import main

    main(argv, prog=f"{PROG} moe-lora")


SUBCOMMANDS = {
    "compare": _compare,
    "losses": _losses,
    "baseline": _baseline,
    "drift": _drift,
    "lm-eval": _lm_eval,
    "pretrain-moe": _pretrain_moe,
    "moe-finetune": _moe_finetune,
    "moe-frontier": _moe_frontier,
    "moe-lora": _moe_lora,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        print(f"{PROG}: error: unknown subcommand ({argv[0]!r}); choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    SUBCOMMANDS[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
