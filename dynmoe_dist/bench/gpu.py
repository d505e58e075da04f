"""`python -m dynmoe_dist.bench gpu --out DIR` (`make gpu-check`): one command that checks and measures
the system on one CUDA machine in at most about 6 minutes, writing DIR/gpu_check.json and
DIR/gpu_check.md.

Each section runs in its own try-block under its own time cap (and all of them under one total
budget), and records pass / fail / skip with the error text, so one failure never loses the rest.
Sections that need CUDA skip with the reason "no CUDA" elsewhere, and the files are still written:
the CPU tests run the whole command.

From a plain checkout with nothing installed and no network (the GPU machine):
    PYTHONPATH=. python -m dynmoe_dist.bench gpu --out runs/gpu_check
dynmoe_dist/__init__.py maps kernels/ to dynmoe_dist.kernels when nothing installed provides it, so no
`pip install -e .` (which needs setuptools) is required. The command imports only torch, triton,
numpy and the standard library (the import_set section checks that on the machine itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from dynmoe_dist.bench import gpu_sections
from dynmoe_dist.bench.gpu_runner import STATUSES, TOTAL_BUDGET_S, Section, Skip, run_sections

__all__ = ["SCHEMA", "Section", "Skip", "build_report", "check_schema", "main", "markdown", "run_sections"]

SCHEMA = "dynmoe_dist.gpu_check/1"


def build_report(records: List[dict], context: dict, wall_s: float) -> dict:
    counts = {status: sum(r["status"] == status for r in records) for status in STATUSES}
    return {
        "schema": SCHEMA,
        "started_utc": context.get("started_utc"),
        "wall_s": round(wall_s, 2),
        "cuda": bool(context.get("cuda")),
        "rehearsal": bool(context.get("rehearsal")),
        "summary": counts,
        "sections": records,
    }


KeyKinds = Dict[str, Union[type, Tuple[type, ...]]]  # key -> the isinstance() classes its value must have
SECTION_KEYS: KeyKinds = {"name": str, "what": str, "cap_s": (int, float), "status": str, "seconds": (int, float)}
REPORT_KEYS: KeyKinds = {
    "schema": str,
    "started_utc": str,
    "wall_s": (int, float),
    "cuda": bool,
    "rehearsal": bool,
    "summary": dict,
    "sections": list,
}


def check_schema(report: dict) -> None:
    """Raise ValueError naming the first key that does not follow the gpu_check/1 layout."""
    for key, kind in REPORT_KEYS.items():
        if not isinstance(report.get(key), kind):
            raise ValueError(f"gpu-check report key {key!r} ({report.get(key)!r}) is not {kind}")
    if report["schema"] != SCHEMA or set(report["summary"]) != set(STATUSES):
        raise ValueError(f"gpu-check report schema ({report['schema']!r}) / summary ({report['summary']}) mismatch")
    for record in report["sections"]:
        for key, kind in SECTION_KEYS.items():
            if not isinstance(record.get(key), kind):
                raise ValueError(f"section {record.get('name')!r} key {key!r} ({record.get(key)!r}) is not {kind}")
        status = record["status"]
        needed = {"pass": "result", "fail": ("error", "result"), "skip": "reason"}[status]
        if not any(k in record for k in ((needed,) if isinstance(needed, str) else needed)):
            raise ValueError(f"section {record['name']!r} with status {status!r} lacks {needed!r}")
    counts = {s: sum(r["status"] == s for r in report["sections"]) for s in STATUSES}
    if counts != report["summary"]:
        raise ValueError(f"summary ({report['summary']}) does not count the sections ({counts})")


def markdown(report: dict) -> str:
    lines = [
        f"# gpu-check ({report['started_utc']}, {report['wall_s']:.0f} s)",
        "",
        "pass {pass}, fail {fail}, skip {skip}".format(**report["summary"]),
        "",
        "| section | status | s | figures / reason |",
        "|---|---|---|---|",
    ]
    for r in report["sections"]:
        detail = r.get("reason") or (r.get("error", "").strip().splitlines() or [""])[-1]
        if r["status"] != "skip" and "result" in r:
            detail = r["result"].get("summary", "")
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: Path) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "gpu_check.json", "markdown": out_dir / "gpu_check.md"}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    paths["markdown"].write_text(markdown(report))
    return paths


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dynmoe_dist.bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--only", default="", help="comma-separated section names (default: all)")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total time budget")
    parser.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="run every section on CPU at toy sizes (tests the check itself; figures mean nothing)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> dict:
    modules_at_start = set(sys.modules)
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    sections: Sequence[Section] = gpu_sections.SECTIONS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in sections})
        if unknown:
            raise ValueError(
                f"--only ({args.only!r}) names unknown sections {unknown}; known: {[s.name for s in sections]}"
            )
        sections = [s for s in sections if s.name in wanted]
    started = time.monotonic()
    context = gpu_sections.make_context(Path(args.out), args.rehearse_on_cpu, modules_at_start)
    report = build_report(run_sections(sections, context, args.budget_s), context, time.monotonic() - started)
    paths = write_outputs(report, Path(args.out))
    print(json.dumps({"summary": report["summary"], **{k: str(v) for k, v in paths.items()}}))
    return report
