"""The dependency direction of docs/architecture.md ("Rooms and rules"), checked by parsing imports (AST),
not by convention.

A module may import its own layer and the layers before it in ORDER, never one after it. ``paths`` (how path
options are read; it imports nothing of the project) sits first after ``kernels``; ``data`` (token files,
read by tasks), ``tasks`` and ``config`` between planning and parallel (they build models and read the
planner's options); ``coordination`` between parallel and train (the trainer calls it); ``bench`` /
``experiments`` / ``export`` after train (they drive the trainer or read its checkpoints), then ``hf`` (the
public re-export of models/hf), ``cluster`` and ``launcher``. LAYER_OF_MODULE places the one module that
sits in a folder other than its layer: ``data/__main__`` (``python -m dynmoe_dist.data`` reads run files).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["dynmoe_dist", "kernels", "cluster", "launcher"]
ORDER = [
    "kernels",
    "paths",
    "moe",
    "models",
    "planning",
    "data",
    "tasks",
    "config",
    "parallel",
    "coordination",
    "train",
    "bench",
    "experiments",
    "export",
    "hf",
    "cluster",
    "launcher",
]
LAYER_OF_FOLDER = {"kernels": "kernels", "cluster": "cluster", "launcher": "launcher"}
# Entry points that live in an early package so that `python -m` finds them there, but read run files.
LAYER_OF_MODULE = {"dynmoe_dist.data.__main__": "train"}


def _module_name(path: Path) -> str:
    """Dotted name as the installed package sees it (kernels/ and cluster/ live in dynmoe_dist)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "cluster"):
        parts = ["dynmoe_dist"] + parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, source: str = None, module: str = None, with_names: bool = False):
    """Absolute names of everything the file imports, relative imports resolved; ``with_names`` adds
    `pkg.name` for every `from pkg import name` (name may be a module)."""
    tree = ast.parse(source if source is not None else path.read_text(), filename=str(path))
    package = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield module
            if node.module is None or with_names:  # `from . import x`: x is a module of the package
                yield from (f"{module}.{alias.name}" for alias in node.names)


def _files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def _all_files():
    return [p for folder in PACKAGES for p in _files(folder)]


def layer_of(module: str):
    """The design layer of a dynmoe_dist module (None: the package root, or outside the project)."""
    if module in LAYER_OF_MODULE:
        return LAYER_OF_MODULE[module]
    parts = module.split(".")
    if parts[0] in LAYER_OF_FOLDER:
        return LAYER_OF_FOLDER[parts[0]]
    if parts[0] != "dynmoe_dist" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


def upward_imports(path: Path, source: str = None, module: str = None):
    module = module or _module_name(path)
    here = layer_of(module)
    if here is None:
        return []
    return [
        f"{path.relative_to(ROOT)} ({here}) imports {name} ({layer_of(name)})"
        for name in _imports(path, source, module)
        if layer_of(name) is not None and ORDER.index(layer_of(name)) > ORDER.index(here)
    ]


def test_every_project_module_has_a_layer():
    unplaced = [
        str(p.relative_to(ROOT))
        for p in _all_files()
        if layer_of(_module_name(p)) is None and _module_name(p) != "dynmoe_dist"
    ]
    assert not unplaced, f"modules outside the design's layers (add them to ORDER): {unplaced}"


def test_nothing_imports_upward():
    offenders = [line for path in _all_files() for line in upward_imports(path)]
    assert not offenders, offenders


def test_the_order_check_catches_upward_imports():
    """The check itself, on planted sources: relative and absolute upward imports are both reported."""
    layer_py = ROOT / "dynmoe_dist" / "moe" / "layer.py"
    planted = "from ..parallel.groups import named\nimport dynmoe_dist.train.loop\nfrom .routing import top_any\n"
    found = upward_imports(layer_py, planted, "dynmoe_dist.moe.layer")
    assert len(found) == 2 and "dynmoe_dist.parallel.groups (parallel)" in found[0], found
    kernels_py = ROOT / "kernels" / "grouped_gemm.py"
    assert upward_imports(kernels_py, "from dynmoe_dist.moe.experts import ExpertBank\n") != []
    assert upward_imports(layer_py, "from dynmoe_dist.kernels import grouped_mm\n", "dynmoe_dist.moe.layer") == []


def test_torch_distributed_only_in_parallel():
    """torch.distributed is imported in parallel/ only; the one exception (docs/architecture.md): train/ may
    import torch.distributed.checkpoint (train/dense_state.py does)."""
    offenders = []
    for path in _all_files():
        here = layer_of(_module_name(path))
        for name in _imports(path):
            if not name.startswith("torch.distributed") or here == "parallel":
                continue
            if here == "train" and name.startswith("torch.distributed.checkpoint"):
                continue
            offenders.append(f"{path.relative_to(ROOT)}: {name}")
        for use in distributed_uses(path.read_text()) if here != "parallel" else ():
            if not (here == "train" and use == "torch.distributed.checkpoint"):
                offenders.append(f"{path.relative_to(ROOT)}: {use}")
    assert not offenders, offenders


def distributed_uses(source: str):
    """``torch.distributed.<name>`` reached through a plain ``import torch`` (no import statement names it)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value
            if inner.attr == "distributed" and isinstance(inner.value, ast.Name) and inner.value.id == "torch":
                yield f"torch.distributed.{node.attr}"


def test_a_use_of_torch_distributed_through_plain_torch_is_seen():
    assert list(distributed_uses("import torch\nrank = torch.distributed.get_rank()\n")) == [
        "torch.distributed.get_rank"
    ]
    assert list(distributed_uses("import torch\nx = torch.nn.Linear(2, 2)\n")) == []


def test_ray_only_inside_cluster():
    offenders = []
    for path in _all_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "cluster":
            continue
        offenders += [f"{rel}: {n}" for n in _imports(path) if n.split(".")[0] == "ray"]
    assert not offenders, offenders


def test_kernels_and_cluster_use_absolute_imports():
    """Relative imports there resolve only through an install's package-dir mapping; static tools and
    Ray working directories read them wrongly."""
    offenders = []
    for folder in ("kernels", "cluster"):
        for path in _files(folder):
            tree = ast.parse(path.read_text())
            offenders += [
                f"{path.relative_to(ROOT)}:{n.lineno}"
                for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.level > 0
            ]
    assert not offenders, offenders


def test_nothing_imports_kernels_bare():
    offenders = []
    for folder in PACKAGES + ["tests"]:
        for path in _files(folder):
            offenders += [str(path.relative_to(ROOT)) for n in _imports(path) if n.split(".")[0] == "kernels"]
    assert not offenders, offenders


# -- the training wing's rules (docs/architecture.md) ---------------------------------------------------
# What code outside train/ may use of a Trainer: its methods and read-only views. Its state (step, the
# parts, the recorders) changes only through train_step() and load_state_dict().
TRAINER_API = {
    "train_step",
    "evaluate",
    "checkpoint_manager",
    "state_dict",
    "step",
    "schedule",
    "config",
    "task",
    "model",
    "groups",
    "moe_layers",
    "world_size",
    "is_rank0",
    "parts",
    "recorders",
}
TRAINER_NAMES = {"trainer", "Trainer"}


def _trainer_uses(tree):
    """(line, attribute, is_store) of every `trainer.<attribute>` in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
            yield node.lineno, node.attr, isinstance(node.ctx, ast.Store)


def trainer_offences(path: Path, source: str = None):
    tree = ast.parse(source if source is not None else path.read_text())
    return [
        f"{path.relative_to(ROOT)}:{line} {'writes' if store else 'reads'} trainer.{attr}"
        for line, attr, store in _trainer_uses(tree)
        if store or attr not in TRAINER_API
    ]


def test_nothing_outside_train_touches_the_trainers_state():
    outside = [p for p in _all_files() if layer_of(_module_name(p)) != "train"]
    offenders = [line for path in outside for line in trainer_offences(path)]
    assert not offenders, offenders


def test_the_trainer_check_catches_writes_and_internals():
    here = ROOT / "dynmoe_dist" / "bench" / "adapt.py"
    planted = "trainer.step = 3\nx = trainer._secret\ny = trainer.train_step()\n"
    assert trainer_offences(here, planted) == [
        "dynmoe_dist/bench/adapt.py:1 writes trainer.step",
        "dynmoe_dist/bench/adapt.py:2 reads trainer._secret",
    ]


# The parts of the training wing that are given what they work on, never the trainer.
TRAINER_FREE = (
    "adaptive.py",
    "calibrate.py",
    "checkpoint.py",
    "checkpoint_parts.py",
    "experts.py",
    "model_files.py",
    "parts.py",
    "dense_state.py",
    "step.py",
)


def test_checkpoints_adaptive_events_and_the_expert_set_never_see_the_trainer():
    offenders = []
    for name in TRAINER_FREE:
        path = ROOT / "dynmoe_dist" / "train" / name
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)
        }
        offenders += [f"train/{name}: {n}" for n in sorted(names & TRAINER_NAMES)]
        offenders += [f"train/{name} imports {m}" for m in _imports(path) if m.endswith("train.loop")]
    assert not offenders, offenders


def _calls_of(path: Path, function: str, by_name_only: bool = False):
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            getattr(node.func, "id", None) == function
            or (not by_name_only and getattr(node.func, "attr", None) == function)
        )
    ]


def test_only_the_expert_set_commits_expert_changes():
    """refresh_param_groups and re-sharding experts after a change happen in ExpertSet._commit only
    (train/parts.py shards the experts once, when the run is assembled)."""
    allowed = {
        "refresh_param_groups": {"dynmoe_dist/train/experts.py"},
        "shard_experts": {"dynmoe_dist/train/experts.py", "dynmoe_dist/train/parts.py"},
        "unshard_experts": {"dynmoe_dist/train/experts.py"},
        "apply_layer_plan": {"dynmoe_dist/train/experts.py"},
        "reshard": {"dynmoe_dist/train/experts.py"},
    }
    offenders = []
    for path in _all_files():
        rel = str(path.relative_to(ROOT))
        for function, places in allowed.items():
            # parallel/reshard.py's reshard is called by name; an FSDP module's own reshard() method (the
            # gathered weights released after an evaluation, parallel/fsdp.py) is another function
            calls = _calls_of(path, function, by_name_only=function == "reshard")
            if rel not in places and calls:
                offenders.append(f"{rel}:{calls} calls {function}")
    assert not offenders, offenders


def test_tasks_import_nothing_from_models():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files("dynmoe_dist/tasks")
        for name in _imports(path)
        if name.startswith("dynmoe_dist.models")
    ]
    assert not offenders, offenders


def test_the_gpu_check_has_no_import_circle():
    """gpu.py -> gpu_sections.py -> gpu_runner.py, gpu_layer.py, gpu_train.py, hf.py: none imports gpu.py back."""
    sections = [p for p in _files("dynmoe_dist/bench") if p.name != "gpu.py"]
    offenders = [
        str(p.relative_to(ROOT))
        for p in sections
        if any(n == "dynmoe_dist.bench.gpu" for n in _imports(p, with_names=True))
    ]
    assert not offenders, offenders


# -- one training step: train/step.py -------------------------------------------------------------------
# A training step is what turns gradients into new weights: an optimizer's step, the optimizer dropping
# the gradients, the gradient sync over ranks (GradSync.sync / clip). Outside train/ only a benchmark's
# baseline (transformers' own way, which ours is compared against) may do it, in the function named here.
STEP_BASELINES = {("dynmoe_dist/bench/hf_moe.py", "transformers_side")}


def _is_step_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    receiver, attr = ast.unparse(node.func.value).split(".")[-1].lower(), node.func.attr
    if attr == "step":
        return receiver.startswith("opt") or "optim" in receiver
    return attr == "zero_grad" or (attr in ("sync", "clip") and "grad_sync" in receiver)


def training_steps(path: Path, source: str = None):
    """`file:line in function` of every optimizer step, zero_grad and gradient sync of a module."""
    rel = str(path.relative_to(ROOT))
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function == "":
            function = node.name  # the top-level function (or method) a call sits in
        if _is_step_call(node) and (rel, function) not in STEP_BASELINES:
            found.append(f"{rel}:{node.lineno} in {function or 'the module'}: {ast.unparse(node.func)}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    tree = ast.parse(source if source is not None else path.read_text())
    for node in tree.body:
        body = node.body if isinstance(node, ast.ClassDef) else [node]  # methods count as functions
        for statement in body:
            visit(statement, "")
    return found


def test_the_training_step_lives_in_train_only():
    outside = [p for p in _all_files() if layer_of(_module_name(p)) != "train"]
    offenders = [line for path in outside for line in training_steps(path)]
    assert not offenders, offenders


def test_the_step_check_catches_optimizer_steps_and_gradient_syncs():
    here = ROOT / "dynmoe_dist" / "bench" / "memory.py"
    planted = (
        "def step(parts, opt):\n"
        "    parts.grad_sync.sync(shards)\n"
        "    parts.optimizer.step()\n"
        "    opt.zero_grad()\n"
        "class Case:\n"
        "    def run(self):\n"
        "        self.optimizer.step()\n"
        "        self.schedule.step()\n"  # not an optimizer
    )
    found = training_steps(here, planted)
    assert [line.split(" in ")[1] for line in found] == [
        "step: parts.grad_sync.sync",
        "step: parts.optimizer.step",
        "step: opt.zero_grad",
        "run: self.optimizer.step",
    ], found
    baseline = ROOT / "dynmoe_dist" / "bench" / "hf_moe.py"
    assert training_steps(baseline, "def transformers_side():\n    optimizer.step()\n") == []
    assert training_steps(baseline, "def ours_side():\n    optimizer.step()\n") != []


# -- the model source is decided once (models/source.py) --------------------------------------------------
# What asks "is it an imported MoE?" (or which family, or whether the model waits on the meta device for its
# weights). Outside models/ the model source answers instead.
SOURCE_QUESTIONS = {"imported_moe", "is_imported", "family_of", "is_on_meta"}


def source_questions(path: Path, source: str = None):
    """(line, question) of every call of a SOURCE_QUESTIONS function and every ``.is_meta`` in a module."""
    tree = ast.parse(source if source is not None else path.read_text())
    rel = path.relative_to(ROOT)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in SOURCE_QUESTIONS:
                found.append((node.lineno, f"calls {name}"))
        elif isinstance(node, ast.Attribute) and node.attr == "is_meta":
            found.append((node.lineno, "reads .is_meta"))
    return [f"{rel}:{line} {what}" for line, what in sorted(found)]


def test_only_models_asks_what_the_model_source_is():
    outside = [p for p in _all_files() if layer_of(_module_name(p)) != "models"]
    offenders = [line for path in outside for line in source_questions(path)]
    assert not offenders, offenders


def test_the_source_check_catches_each_question():
    here = ROOT / "dynmoe_dist" / "export.py"
    planted = (
        "imported_moe(d)\nx = pretrained.is_imported(t)\nfamily_of(m)\nany(p.is_meta for p in ps)\n"
        "is_on_meta(m)\nsource.fill(h, d, f)\n"
    )
    assert source_questions(here, planted) == [
        "dynmoe_dist/export.py:1 calls imported_moe",
        "dynmoe_dist/export.py:2 calls is_imported",
        "dynmoe_dist/export.py:3 calls family_of",
        "dynmoe_dist/export.py:4 reads .is_meta",
        "dynmoe_dist/export.py:5 calls is_on_meta",
    ]


# -- the model wing's rule: one family, one place (models/hf/families/) ---------------------------------------
FAMILY_HOME = "dynmoe_dist/models/hf/"
# The one family name that is also a name outside the wing: moe/'s expert kind 'gpt_oss' (gpt-oss's clamped
# SwiGLU expert), which exports and training checkpoints record.
EXPERT_KIND_NAMES = {("gpt_oss", "dynmoe_dist/moe/")}


def _family_names():
    """(model types, adapter class names) of every family the registry holds, and the adapters' bases."""
    from dynmoe_dist.models.hf.families import FAMILIES
    from dynmoe_dist.models.hf.families.base import MoEFamily

    classes = {base.__name__ for cls in FAMILIES.values() for base in cls.__mro__ if issubclass(base, MoEFamily)}
    return set(FAMILIES), classes


def family_offences(path: Path, source: str = None, names=None):
    """A family's model type as a string, or an isinstance on a family adapter class, in ``path``."""
    rel = str(path.relative_to(ROOT))
    if rel.startswith(FAMILY_HOME):
        return []
    model_types, classes = names or _family_names()
    tree = ast.parse(source if source is not None else path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in model_types:
            if not any(node.value == name and rel.startswith(home) for name, home in EXPERT_KIND_NAMES):
                found.append((node.lineno, f"names the family {node.value!r}"))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            found += [(node.lineno, f"isinstance on the family class {c}") for c in sorted(named & classes)]
    return [f"{rel}:{line} {what}" for line, what in sorted(found)]


def test_no_family_is_named_outside_models_hf():
    offenders = [line for path in _all_files() for line in family_offences(path)]
    assert not offenders, offenders


def test_the_family_check_catches_names_and_isinstance():
    here = ROOT / "dynmoe_dist" / "export.py"
    planted = 'if kind == "deepseek_v3":\n    pass\nok = isinstance(family, (Qwen2MoE, GptOss))\nx = "gpt_oss"\n'
    assert family_offences(here, planted) == [
        "dynmoe_dist/export.py:1 names the family 'deepseek_v3'",
        "dynmoe_dist/export.py:3 isinstance on the family class GptOss",
        "dynmoe_dist/export.py:3 isinstance on the family class Qwen2MoE",
        "dynmoe_dist/export.py:4 names the family 'gpt_oss'",
    ]
    assert family_offences(ROOT / "dynmoe_dist" / "moe" / "config.py", 'k = "gpt_oss"\n') == []
    inside = ROOT / "dynmoe_dist" / "models" / "hf" / "moe_import.py"
    assert family_offences(inside, planted) == []
