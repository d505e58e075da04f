"""Run configuration: nested dataclasses, one docstring per field, validated in ``__post_init__``.

A run file is TOML with one table per section (``[train]``, ``[moe]``, ...); ``--set section.key=value``
overrides any field. Unknown sections or keys are errors that list the valid names. The sections are
config/sections.py; this module holds the run as a whole, reading and checking it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import os
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, get_type_hints

from ..moe.config import PRESETS, MoEConfig, _require, conforms, describe
from ..paths import missing
from .sections import (
    ACTIVATION_CHECKPOINTING,
    ADD_REMOVE_OPTIONS,
    BUILTIN_NUM_LAYERS,
    EXPERT_INITS,
    MODEL_PATH_FORMS,
    MODEL_SOURCE_HELP,
    MODEL_SOURCES,
    PRECISIONS,
    SECTIONS,
    SHARDINGS,
    AdaptiveConfig,
    FaultConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "ADD_REMOVE_OPTIONS",
    "AdaptiveConfig",
    "BUILTIN_NUM_LAYERS",
    "DERIVED_MOE_KEYS",
    "EXPERT_INITS",
    "FaultConfig",
    "MODEL_PATH_FORMS",
    "MODEL_SOURCES",
    "MODEL_SOURCE_HELP",
    "MoEConfig",
    "ModelConfig",
    "OutputConfig",
    "PRECISIONS",
    "ParallelConfig",
    "RunConfig",
    "SECTIONS",
    "SHARDINGS",
    "TaskConfig",
    "TrainConfig",
    "check_native_router",
    "check_resume",
    "check_world",
    "checked_values",
    "field_docs",
    "field_types",
    "from_dict",
    "model_source_defaults",
    "load_config",
    "make_section",
    "options_help",
    "toml_value",
    "parse_override",
    "read_toml",
    "resolve_num_layers",
    "with_preset",
    "world_size_from_env",
]


@dataclass
class RunConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    explicit: FrozenSet[str] = field(default_factory=frozenset, compare=False, repr=False)
    """'section.key' of every option the user set (file or --set), recorded by the loader: start-up
    checks fail for a feature asked for by name but only warn about a default (train/startup.py)."""

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def digest(self) -> str:
        """Hash of everything that must agree across ranks (the output section may differ)."""
        payload = {k: v for k, v in self.to_dict().items() if k not in ("output", "fault")}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_toml(self, notes: Optional[Dict[str, str]] = None) -> str:
        """The run file of this config; ``notes`` ('section.key' -> text) become a comment after a value."""
        notes = notes or {}
        lines = []
        for name, values in self.to_dict().items():
            lines.append(f"[{name}]")
            lines += [
                f"{key} = {toml_value(value)}" + (f"  # {notes[f'{name}.{key}']}" if f"{name}.{key}" in notes else "")
                for key, value in values.items()
                if value is not None and not (name == "moe" and key in DERIVED_MOE_KEYS)
            ]
            lines.append("")
        return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def field_docs(cls) -> Dict[str, str]:
    """The docstring written under each dataclass field (parsed from the source)."""
    tree = ast.parse(inspect.getsource(cls))
    node0 = tree.body[0]
    assert isinstance(node0, ast.ClassDef), f"{cls} is not a class"
    docs: Dict[str, str] = {}
    body = node0.body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _check_keys(section: str, values: Dict[str, Any]) -> None:
    valid = [f.name for f in dataclasses.fields(SECTIONS[section])]
    for key in values:
        if key not in valid:
            raise ValueError(f"unknown key {section}.{key}; valid keys of [{section}]: {', '.join(valid)}")


# The model decides these for every MoE layer; accepting them here would silently do nothing. Key -> where
# the value comes from, for the message.
DERIVED_MOE_KEYS = (
    "dim",
    "ffn_dim",
    "swiglu_alpha",
    "swiglu_limit",
    "adapter_rank",
    "adapter_alpha",
    "base_dtype",
    "added_experts",
)
_DERIVED_FROM = {
    "dim": "model.dim for built models, the pre-trained block for minilm-sentiment; set model.dim instead",
    "ffn_dim": "model.ffn_dim for built models, the pre-trained block for minilm-sentiment; set model.ffn_dim instead",
    "swiglu_alpha": "the gpt-oss checkpoint's config",
    "swiglu_limit": "the gpt-oss checkpoint's config",
    "adapter_rank": "LoRA's rank with 'routed_experts' among its targets (models/lora.py)",
    "adapter_alpha": "LoRA's alpha with 'routed_experts' among its targets (models/lora.py)",
    "base_dtype": "lora.base_dtype (models/lora.py)",
    "added_experts": "lora.added_experts (models/lora.py)",
}


def with_preset(data: Dict[str, Any]) -> Dict[str, Any]:
    """data with the moe.preset's values (moe/config.py PRESETS) filled in wherever the user set nothing;
    unchanged unless the router is top-any. The caller records what the user set before this."""
    moe = data.get("moe", {}) if isinstance(data.get("moe", {}), dict) else {}
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    name, router = moe.get("preset", defaults["preset"]), moe.get("router", defaults["router"])
    if name not in PRESETS:  # checked here too: an unknown preset must fail, whatever the router
        raise ValueError(f"moe.preset ({name!r}) must be one of {tuple(PRESETS)}")
    if router != "top_any":
        return data
    out = dict(data)
    for option, value in PRESETS[name].items():
        section, key = option.split(".")
        if isinstance(out.get(section, {}), dict):  # a malformed section fails in from_dict, with its name
            out[section] = {key: value, **out.get(section, {})}
    return out


def from_dict(data: Dict[str, Dict[str, Any]]) -> RunConfig:
    explicit = frozenset(f"{name}.{key}" for name, values in data.items() if isinstance(values, dict) for key in values)
    data = with_preset(data)
    for key in DERIVED_MOE_KEYS:
        if key in data.get("moe", {}):
            raise ValueError(f"moe.{key} is taken from the model ({_DERIVED_FROM[key]})")
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ValueError(f"unknown section [{name}]; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"section [{name}] must be a table, got {values!r}")
        _check_keys(name, values)
        sections[name] = make_section(name, checked_values(name, values))
    return RunConfig(**sections, explicit=explicit)


def make_section(name: str, values: Dict[str, Any]):
    try:
        return SECTIONS[name](**values)
    except ValueError as err:
        # MoEConfig is also the layer's own config, so its messages name the bare field ("top_k (9) ...");
        # in a run file the option is moe.top_k.
        if name == "moe":
            raise ValueError(f"moe.{err}") from None
        raise


# -- value types, checked from the dataclass annotations ---------------------------------------------


@lru_cache(maxsize=None)
def field_types(cls) -> Dict[str, Any]:
    """Field name -> resolved annotation (the modules use postponed annotations, so resolve them here)."""
    return get_type_hints(cls)


def checked_values(section: str, values: Dict[str, Any]) -> Dict[str, Any]:
    """Raise naming the option and the value when a value has the wrong type; ints become floats for
    float fields, so a config means the same (and hashes the same) whether it says 2 or 2.0."""
    types, out = field_types(SECTIONS[section]), {}
    for key, value in values.items():
        if not conforms(value, types[key]):
            raise ValueError(f"{section}.{key} ({value!r}) must be {describe(types[key])}")
        out[key] = float(value) if types[key] is float else value
    return out


# -- cross-section checks -------------------------------------------------------------------------


def check_world(config: RunConfig, world_size: Optional[int]) -> None:
    """ep_size and the batch against the world (when the launcher told us its size), ep_size against the
    expert count. The trainer checks the same against the live group; this fails before it starts."""
    ep_size, num_experts, train = config.parallel.ep_size, config.moe.num_experts, config.train
    if world_size is not None:
        _require(
            ep_size == 0 or world_size % ep_size == 0,
            f"parallel.ep_size ({ep_size}) does not divide the world size ({world_size})",
        )
        ep_size = ep_size or world_size
        micro = train.global_batch_size // train.grad_accum
        _require(
            micro >= world_size,
            f"micro-batch size ({micro} = train.global_batch_size "
            f"{train.global_batch_size} / train.grad_accum {train.grad_accum}) < world size ({world_size}): "
            "some ranks would get no samples",
        )
    _require(
        num_experts >= ep_size,
        f"moe.num_experts ({num_experts}) < ep_size ({ep_size}): every rank of an expert-parallel group "
        "(parallel.ep_size) needs at least one expert",
    )


def check_resume(output: OutputConfig) -> None:
    """A resume path names a checkpoint directory (train/checkpoint.py checks its content when it loads)."""
    if output.resume in ("", "auto"):
        return
    if not (Path(output.resume) / "meta.pt").is_file():
        raise missing(
            "output.resume",
            output.resume,
            "is not a checkpoint directory: it has no meta.pt (use 'auto' for the newest checkpoint in output.out_dir)",
        )


def world_size_from_env() -> Optional[int]:
    """WORLD_SIZE as torchrun (and run_simulated) set it; None when this process was not launched as
    part of a group (then the size is only known when the group starts)."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"environment variable WORLD_SIZE ({raw!r}) must be a positive integer")
    return int(raw)


# -- loading --------------------------------------------------------------------------------------


def parse_override(text: str) -> Tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); the value is read as TOML, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def read_toml(path: str) -> Dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise missing("config file", path)
    try:
        return tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config file ({path}) is not valid TOML: {err}") from None


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> RunConfig:
    """File + overrides -> a RunConfig in which every mistake the loader can see has been an error:
    types, ranges, cross-section sizes, the task's name and the model shapes it can build."""
    data: Dict[str, Dict[str, Any]] = read_toml(path) if path else {}
    for text in overrides or []:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}] in --set {text}; valid sections: {', '.join(SECTIONS)}")
        _check_keys(section, {key: value})
        section_values = data.setdefault(section, {})
        if not isinstance(section_values, dict):
            raise ValueError(f"section [{section}] must be a table, got {section_values!r}")
        section_values[key] = value
    user_set = frozenset(f"{name}.{key}" for name, values in data.items() if isinstance(values, dict) for key in values)
    model_source_defaults(data)
    config = dataclasses.replace(from_dict(data), explicit=user_set)
    check_world(config, world_size_from_env())
    check_resume(config.output)
    # Imported here: the tasks import torch and the models, which config.py must not need to load.
    from ..models.build import check_model_config, check_packed_attention
    from ..models.lora import check_run_support
    from ..tasks import task_spec, validate_run_config

    check_native_router(config.model, config.moe.router)
    check_run_support(config.lora, config.parallel.expert_sharding)
    validate_run_config(config)
    spec = task_spec(config.task.name)
    check_model_config(config.model, spec.model_kind)
    if spec.packs_sequences:
        check_packed_attention(config.model.path)
    if "model.path" in (spec.reads or ()):
        resolve_num_layers(config.model)
    return config


def model_source_defaults(data: Dict[str, Any]) -> None:
    """What the model at model.path fixes of the run's options (models.source.fixed_options: an imported
    transformers MoE's expert count and sparse blocks, its own routing unless moe.router says otherwise),
    applied before the DynMoE preset could fill in top-any's options. Reads config.json only; no weights."""
    model, moe = data.get("model", {}), data.setdefault("moe", {})
    if not isinstance(model, dict) or not isinstance(moe, dict) or model.get("source") != "hf":
        return
    from ..models.source import fixed_options

    found = fixed_options(str(model.get("path", "")))
    if found is None:
        return
    sections = {"model": model, "moe": moe}
    for option, bound in found.at_most.items():
        section, key = option.split(".")
        value = sections[section].get(key, 0)
        if isinstance(value, int) and value > bound:
            raise ValueError(f"{option} ({value}) > the {bound} experts: {found.reason}")
    for option, value in found.fixed.items():
        section, key = option.split(".")
        have = sections[section].get(key, value)
        if _unordered(have) != _unordered(value):  # equal: a printed config read back
            raise ValueError(f"{option} ({have!r}) cannot be set: {found.reason} ({option} = {value!r})")
        sections[section][key] = value
    for option, value in found.defaults.items():
        section, key = option.split(".")
        sections[section].setdefault(key, value)
    if moe["router"] == "native" and moe.get("balance") == "bias" and not found.correction_bias:
        raise ValueError(
            f"moe.balance ('bias') needs a correction bias to move, and its native router has none: {found.reason}"
        )


NATIVE_INSTEAD = (
    "leave moe.router unset (top_any: DynMoE, its feed-forward blocks made experts), or use 'top_k' or 'top_p'"
)


def check_native_router(model: ModelConfig, router: str) -> None:
    """moe.router = 'native' keeps the routing of an imported transformers MoE, so model.path must be one: a
    one-line error otherwise, from its config.json or GGUF header (no weights read, nothing dequantised)."""
    if router != "native":
        return
    asked = "moe.router ('native') keeps the routing of an imported mixture-of-experts model"
    if model.source != "hf":
        raise ValueError(
            f"{asked}, but model.source ({model.source!r}) builds this project's own model: {NATIVE_INSTEAD}"
        )
    from ..models.hf.loading import gguf_header, read_config_json, resolve
    from ..models.source import moe_at

    directory, gguf_file = resolve(model.path)
    where = f"model.path ({model.path!r})"
    if gguf_file is None:
        if moe_at(directory) is None:
            model_type = read_config_json(directory).get("model_type", "?")
            raise ValueError(f"{asked}, but {where} is a dense {model_type} model: {NATIVE_INSTEAD}")
        return
    header = gguf_header(directory / gguf_file)
    if header.expert_count:
        raise ValueError(
            f"{asked}, but {where} is a GGUF {header.architecture} with {header.expert_count} experts per layer, "
            "and mixture-of-experts models are imported from a transformers directory (config.json + "
            "safetensors, as save_pretrained writes it): give that directory instead"
        )
    raise ValueError(
        f"{asked}, but {where} is a dense {header.architecture} model (its GGUF header has no "
        f"{header.architecture}.expert_count): {NATIVE_INSTEAD}"
    )


def _unordered(value: Any) -> Any:
    return sorted(value) if isinstance(value, list) else value


def resolve_num_layers(model: ModelConfig) -> None:
    """model.source = 'hf': num_layers from the model's own config when not set (0); a set value must agree.
    Only the config is read (config.json, or the GGUF header), no weights."""
    if model.source != "hf":
        return
    from ..models.hf.loading import num_blocks  # imports torch: config.py must load without it

    found = num_blocks(model.path, "model.path")
    _require(
        model.num_layers in (0, found),
        f"model.num_layers ({model.num_layers}) != the {found} blocks of the model at model.path "
        f"({model.path!r}); leave model.num_layers unset to use the model's own count",
    )
    model.num_layers = found
    model.check_moe_layers()


def options_help(choices: Optional[Dict[str, List[str]]] = None) -> str:
    """Every option with its default and meaning, for `dynmoe-train --help`; ``choices[option]`` lines
    (the registered tasks, model sources, path forms: kept where they are defined) follow its meaning."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"[{name}]")
        docs, defaults = field_docs(cls), dataclasses.asdict(cls())
        for f in dataclasses.fields(cls):
            option = f"{name}.{f.name}"
            lines.append(f"  {option} = {defaults[f.name]!r}\n      {docs.get(f.name, '')}")
            lines += [f"        {line}" for line in (choices or {}).get(option, [])]
    return "\n".join(lines)
