"""What a finished run tells its user, whichever launcher ran it (dynmoe-train, torchrun, a Ray job): where its
files are and the command to run next. ``finished_files`` finds them on disk; ``cli.summary`` prints them."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from .checkpoint import complete_checkpoints


def finished_files(out_dir: str, exportable: bool, report: Optional[Path] = None) -> Dict[str, str]:
    """The report (when drawn), the newest complete checkpoint, and the command that exports it when the
    model can be exported (``exportable``: model.source = 'hf')."""
    files = {"report": str(report)} if report is not None else {}
    found = complete_checkpoints(out_dir)
    if found:
        files["checkpoint"] = str(found[-1])
        if exportable:
            files["export_command"] = f"python -m dynmoe_dist.export {found[-1]} --out {Path(out_dir) / 'export'}"
    return files
