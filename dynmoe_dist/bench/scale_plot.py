"""docs/scale.png from the JSON of ``python -m dynmoe_dist.bench scale`` (matplotlib, imported here only)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

PLACEMENTS = (
    ("initial", "traffic_initial", "imbalance_before"),
    ("rebalanced, no replicas", "traffic_rebalanced_no_replication", "imbalance_after_no_replication"),
    ("planned with replicas", "traffic_replicated", "imbalance_after"),
)


def _largest(cases: List[Dict], factor: float) -> List[Dict]:
    top = max(c["ranks"] for c in cases)
    return [c for c in cases if c["ranks"] == top and c["replicate_factor"] == factor]


def plot(result: Dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    factor = min(c["replicate_factor"] for c in cases)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for experts in sorted({c["experts"] for c in cases}):
        for f, style in ((factor, "-o"), (max(c["replicate_factor"] for c in cases), "--s")):
            rows = sorted({c["ranks"] for c in cases})
            worst = [
                max(
                    c["plan_cpu_s"]
                    for c in cases
                    if c["ranks"] == r and c["experts"] == experts and c["replicate_factor"] == f
                )
                for r in rows
            ]
            axes[0].plot(rows, worst, style, label=f"E={experts}, replicate_factor {f}")
    axes[0].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="ranks",
        ylabel="plan time per layer, CPU s (worst profile)",
        title="planner time",
    )
    axes[0].legend(fontsize=7)
    largest = _largest(cases, factor)
    short = lambda name: name.replace("zipf+shared ", "zipf ").replace("recorded layer ", "rec. L")  # noqa: E731
    labels = [f"E={c['experts']}\n{short(c['profile'])}" for c in largest]
    width = 0.27
    for i, (name, traffic, imbalance) in enumerate(PLACEMENTS):
        xs = [j + (i - 1) * width for j in range(len(largest))]
        axes[1].bar(xs, [c[imbalance] for c in largest], width, label=name)
        axes[2].bar(xs, [c[traffic]["all_to_all_ms"] for c in largest], width, label=name)
    for ax, ylabel, title in (
        (axes[1], "max / mean rank load", "rank load imbalance"),
        (axes[2], "ms per all-to-all (alpha-beta model)", "one dispatch exchange"),
    ):
        ax.set_xticks(range(len(largest)), labels, fontsize=7)
        ax.set(yscale="log", ylabel=ylabel, title=f"{title}, {largest[0]['ranks']} ranks (factor {factor})")
        ax.legend(fontsize=7)
    axes[1].axhline(1.05, color="grey", lw=0.8, ls=":")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
