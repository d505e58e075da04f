"""The tokenizer stored with a pre-trained model (its files in the directory, or inside the GGUF file),
loaded from a local path like the model itself (models/hf/loading.py resolves the path); nothing is
downloaded. Tasks and the token cache tokenise with it; the export writes it next to the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from ..models.hf.loading import _transformers, resolve

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str, field: str = "model.path"):
    """The tokenizer stored with the model (its files in the directory, or inside the GGUF file)."""
    directory, gguf_file = resolve(path, field)
    if gguf_file is None and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{field} ({path!r}) holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    tf = _transformers()
    kwargs: Dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(str(directory), **kwargs)
        if gguf_file is None and not same_algorithm(tokenizer, directory):
            tokenizer = declared_tokenizer(directory, path, field)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{field} ({path!r}): the tokenizer could not be loaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    return tokenizer


def saved_algorithm(directory: Path) -> Optional[str]:
    """The tokenizer.json's model type ('WordPiece', 'BPE', 'Unigram', 'WordLevel'), if the file is there."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type")


def same_algorithm(tokenizer, directory: Path) -> bool:
    """Whether the loaded tokenizer runs the algorithm its tokenizer.json holds. transformers 5 replaces the
    class a tokenizer_config.json names by the one registered for some model types (qwen2, phi3...: their
    hub files name wrong classes), and that class rebuilds its own pipeline: a BERT WordPiece tokenizer
    saved next to a Qwen2 model turns into a character-level BPE with an added <|endoftext|> token."""
    saved = saved_algorithm(directory)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return saved is None or backend is None or type(backend.model).__name__ == saved


def declared_tokenizer(directory: Path, path: str, field: str):
    """The class tokenizer_config.json names, loaded directly (see same_algorithm for why)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config_file = directory / "tokenizer_config.json"
    declared = (
        json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class") if config_file.is_file() else None
    )
    cls = tokenizer_class_from_name(declared) if declared else None
    tokenizer = cls.from_pretrained(str(directory), local_files_only=True) if cls is not None else None
    if tokenizer is None or not same_algorithm(tokenizer, directory):
        raise ValueError(
            f"{field} ({path!r}): transformers loads a tokenizer that does not run the {saved_algorithm(directory)} "
            f"model of its tokenizer.json, and the class tokenizer_config.json names ({declared!r}) does not either"
        )
    return tokenizer
