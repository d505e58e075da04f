"""The dependency direction of DESIGN.md, checked by parsing imports (AST), not by convention."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = ["dynmoe_dist/moe", "dynmoe_dist/models", "dynmoe_dist/planning", "kernels"]
PACKAGES = ["dynmoe_dist", "kernels", "cluster", "launcher"]


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_pure_packages_never_import_distributed_or_ray():
    offenders = []
    for folder in PURE:
        for path in _files(folder):
            for name in _imports(path):
                if name.startswith("torch.distributed") or name.split(".")[0] == "ray":
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders
    assert _files("dynmoe_dist/moe"), "the check must look at real files"


COLLECTIVE_CALLERS = ("dynmoe_dist/parallel", "dynmoe_dist/coordination.py", "dynmoe_dist/train", "cluster")


def test_torch_distributed_only_where_collectives_belong():
    offenders = []
    for folder in PACKAGES:
        for path in _files(folder):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(COLLECTIVE_CALLERS):
                continue
            offenders += [f"{rel}: {n}" for n in _imports(path) if n.startswith("torch.distributed")]
    assert not offenders, offenders


def test_ray_only_inside_cluster():
    offenders = []
    for folder in PACKAGES:
        for path in _files(folder):
            rel = path.relative_to(ROOT)
            if rel.parts[0] == "cluster":
                continue
            offenders += [f"{rel}: {n}" for n in _imports(path) if n.split(".")[0] == "ray"]
    assert not offenders, offenders


def test_nothing_imports_kernels_bare():
    offenders = []
    for folder in PACKAGES + ["tests"]:
        for path in _files(folder):
            offenders += [str(path.relative_to(ROOT)) for n in _imports(path) if n.split(".")[0] == "kernels"]
    assert not offenders, offenders
