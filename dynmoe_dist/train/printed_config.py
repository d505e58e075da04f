"""What ``--print-config`` prints: the resolved run file, with what an imported MoE's own config decides.

A run importing a transformers MoE (model.source = 'hf' naming Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3 or
gpt-oss) takes its sizes, expert count, sparse blocks and expert kind from the checkpoint's config.json
(models/hf/families/ ``layer_config``), whatever the run file says. The printed config shows those
values, each with a comment saying so and which value of the run file it overrides, so that what is
printed is what runs (and reads back as the same run).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from ..config import RunConfig, toml_value

SOURCE = "config.json"


def printed_config(config: RunConfig) -> str:
    decided = checkpoint_decisions(config)
    shown, notes = with_decisions(config, decided)
    return shown.to_toml(notes)


def checkpoint_decisions(config: RunConfig) -> Dict[str, Any]:
    """'section.key' -> the value an imported MoE's config.json fixes; {} for any other run. Reads the
    config only, no weights."""
    if config.model.source != "hf":
        return {}
    from ..models.source import decided_options

    return decided_options(config.model.path, config.moe)


def with_decisions(config: RunConfig, decided: Dict[str, Any]) -> Tuple[RunConfig, Dict[str, str]]:
    """The config with the decided values in place, and the comment for each: where it comes from and, when
    the run file's value differs, which value it overrides."""
    notes: Dict[str, str] = {}
    sections: Dict[str, Dict[str, Any]] = {}
    for option, value in decided.items():
        section, key = option.split(".")
        before = getattr(getattr(config, section), key)
        notes[option] = f"from {SOURCE}" + ("" if before == value else f" (overrides {toml_value(before)})")
        sections.setdefault(section, {})[key] = value
    shown = dataclasses.replace(
        config,
        **{name: dataclasses.replace(getattr(config, name), **values) for name, values in sections.items()},
    )
    return shown, notes
