"""build_model(model, moe, needs): every model a run trains, built from the run's ``[model]`` and ``[moe]``
sections and from what its task hands over. Tasks never build, load, upcycle or freeze a model; the
trainer, the export and the analyses call this one function.

``needs`` is the task's ``tasks.base.ModelNeeds`` (read here through the ``TaskNeeds`` protocol: models/
sits below tasks/ and does not import it): the kind of model the task feeds, and only what the task
knows: class or vocabulary counts, sequence length, image size, the tokenizer it used.

  needs.kind          model.source  model
  token-classifier    builtin       EncoderClassifier (transformer.py), from scratch; MoE in model.moe_layers
  image-classifier    builtin       ViTClassifier, from scratch
  minilm-classifier   builtin       the pre-trained all-MiniLM-L6-v2 in needs.tokenizer's directory + a
                                    fresh head; the FFNs of model.moe_layers upcycled into DynMoE layers
  causal-lm           hf            model.path through transformers; the dense MLPs of model.moe_layers
                                    upcycled; wrapped as HFCausalLM. A transformers MoE (a family of
                                    models/hf/families/) is imported instead: its sparse blocks become
                                    MoE layers (its own routing or top-any), built on the meta device and
                                    filled after placement (each rank reads its share: models/hf/imported.py)
  causal-lm           builtin       CausalLM (transformer.py), from scratch
Then the parameters under the ``model.freeze`` prefixes are frozen (prefixes as the model names them:
'model.embed_tokens' for a transformers LM, 'embeddings' / 'layers.N' or 'bert...' for MiniLM).

What is built is decided here once and returned as its model source (models/source.py): the model and
everything that follows from where it came from (filling, calibration, saving). ``definition`` builds a
transformers source without weights, on the meta device, from a training checkpoint's copy of the base's
config files (the export: the checkpoint holds every weight, model.path may be gone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
import torch.nn as nn

from ..moe.config import MoEConfig
from .source import BuiltModel, ImportedMoE, ModelSource, UpcycledHF, moe_at, upcycled_mlps
from .transformer import CausalLM, EncoderClassifier, ModelShape, ViTClassifier

MODEL_KINDS = ("token-classifier", "image-classifier", "minilm-classifier", "causal-lm")


class TaskNeeds(Protocol):
    """What a task tells the builder (tasks.base.ModelNeeds, a frozen dataclass: read-only here)."""

    @property
    def kind(self) -> str: ...

    @property
    def num_outputs(self) -> int:
        """Classes of a classifier; the tokenizer's vocabulary of a causal LM."""
        ...

    @property
    def max_len(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids of a token classifier's own vocabulary."""
        ...

    @property
    def image_size(self) -> int: ...

    @property
    def channels(self) -> int: ...

    @property
    def tokenizer(self) -> str:
        """The pre-trained tokenizer (a directory or .gguf file) the task used, if any."""
        ...


class ModelSection(ModelShape, Protocol):
    """The fields of the run's [model] section (config.ModelConfig) the builder reads: the built models'
    shape and where a pre-trained model comes from, and what to freeze."""

    source: str
    path: str
    freeze: List[str]


def build_model(model: ModelSection, moe: MoEConfig, needs: TaskNeeds, definition: Optional[str] = None) -> ModelSource:
    """The run's model in float32 and training mode, its MoE layers in place, model.freeze applied, as its
    source. ``definition``: a transformers model's config files to build it from without weights (export)."""
    check_model_config(model, needs.kind)
    if definition is not None:
        assert (needs.kind, model.source) == ("causal-lm", "hf"), "only transformers models are built empty"
        return _hf_causal_lm_empty(definition, model, moe, needs)
    return BUILDERS[(needs.kind, model.source)](model, moe, needs)


def freeze_parameters(model: nn.Module, prefixes: Iterable[str]) -> List[str]:
    """Set requires_grad=False on every parameter named ``prefix`` or ``prefix.<anything>``.

    Matching stops at dots, so 'layers.1' freezes layer 1 and not layer 10. A prefix that matches no
    parameter is a mistake (a typo would otherwise silently train everything): ValueError.
    Returns the names of the frozen parameters."""
    named = dict(model.named_parameters())
    frozen: List[str] = []
    for prefix in prefixes:
        prefix = prefix.rstrip(".")
        hits = [name for name in named if name == prefix or name.startswith(prefix + ".")]
        if not hits:
            tops = sorted({name.split(".")[0] for name in named})
            raise ValueError(f"model.freeze entry ({prefix!r}) matches no parameter; top-level names: {tops}")
        for name in hits:
            named[name].requires_grad_(False)
        frozen += hits
    return sorted(set(frozen))


def check_model_config(model: ModelSection, kind: str) -> None:
    """What can be checked of [model] for a task kind before anything is loaded: the source can build the
    kind, and a transformer built from model.* (not loaded) splits dim evenly over its heads."""
    if (kind, model.source) not in BUILDERS:
        sources = sorted(source for k, source in BUILDERS if k == kind)
        raise ValueError(f"model.source ({model.source!r}) cannot build a {kind} model; use one of {sources}")
    if kind in BUILT_FROM_CONFIG and model.source == "builtin" and model.dim % model.num_heads:
        raise ValueError(f"model.dim ({model.dim}) is not divisible by model.num_heads ({model.num_heads})")


def check_packed_attention(model_path: str) -> None:
    """ValueError for a model at model.path whose attention transformers would not make block-diagonal from
    restarting position ids (a task that packs examples into one row needs it). Reads config.json only."""
    from .hf.families import packs_by_position_ids
    from .hf.loading import read_config_json, resolve

    directory, gguf_file = resolve(model_path)
    model_type = "" if gguf_file else str(read_config_json(directory).get("model_type", ""))
    if not packs_by_position_ids(model_type):
        raise ValueError(
            f"task 'chat' packs conversations into sequences told apart by their position ids, and transformers' "
            f"{model_type} (model.path {model_path!r}) builds its attention mask without them: the conversations "
            "would attend to each other; train this model with task 'causal-lm'"
        )


# -- the builders, one per (task kind, model source) ----------------------------------------------------
def _token_classifier(model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    built = EncoderClassifier(model, moe, needs.vocab_size, needs.max_len, needs.num_outputs)
    freeze_parameters(built, model.freeze)
    return BuiltModel(built)


def _image_classifier(model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    built = ViTClassifier(model, moe, needs.image_size, needs.channels, needs.num_outputs)
    freeze_parameters(built, model.freeze)
    return BuiltModel(built)


def _builtin_causal_lm(model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    built = CausalLM(model, moe, needs.num_outputs, needs.max_len)
    freeze_parameters(built, model.freeze)
    return BuiltModel(built)


def _minilm_classifier(model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    """MiniLM (its first model.num_layers layers) + a head; dim and ffn_dim come from the pre-trained block."""
    from .hf.minilm import HFSentenceClassifier, freeze_names, load_minilm
    from .hf.upcycle import upcycle_hf

    built = HFSentenceClassifier(load_minilm(needs.tokenizer, model.num_layers, model.dropout), needs.num_outputs)
    if model.moe_layers:
        upcycle_hf(built.bert, moe, layers=list(model.moe_layers))
    freeze_parameters(built, freeze_names(model.freeze))
    return BuiltModel(built)


def _hf_causal_lm(model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    from .hf.loading import load_resolved, resolve

    directory, gguf_file = resolve(model.path)
    if gguf_file is None and moe_at(directory) is not None:
        return _imported_moe(directory, model, moe, needs)
    built = hf_causal_lm_from(load_resolved(directory, gguf_file, model.path), model, moe, needs)
    return UpcycledHF(built, model.path, moe, tuple(model.moe_layers), dense_mlps=upcycled_mlps(built))


def _imported_moe(directory: Path, model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    """A transformers MoE with MoE blocks in place of its sparse blocks (its own routing, or converted to
    top-any), on the meta device: the trainer reads each rank's share of the weights once it has placed the
    experts and sharded the dense weights (train/parts.py). The checkpoint's tensors are checked here, so a
    bad file fails before any process group exists."""
    from .hf import HFCausalLM
    from .hf.imported import build_on_meta, open_imported

    hf_model = build_on_meta(directory, moe)
    checkpoint = open_imported(directory, hf_model)
    _check_vocabulary(hf_model, needs)
    freeze_parameters(hf_model, model.freeze)
    return ImportedMoE(HFCausalLM(hf_model), model.path, moe, tuple(model.moe_layers), checkpoint)


def _hf_causal_lm_empty(definition: str, model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> ModelSource:
    """The model ``_hf_causal_lm`` builds, from the config files at ``definition`` alone, every parameter on
    the meta device (``allocate`` gives it storage; the caller fills it)."""
    from .hf import HFCausalLM
    from .hf.imported import build_empty, build_on_meta
    from .hf.loading import resolve

    directory, gguf_file = resolve(definition, "the checkpoint's model definition")
    if gguf_file is None and moe_at(directory) is not None:
        hf_model = build_on_meta(directory, moe)
        _check_vocabulary(hf_model, needs)
        return ImportedMoE(HFCausalLM(hf_model), model.path, moe, tuple(model.moe_layers), None)
    with torch.device("meta"):  # the upcycled experts copy meta MLPs: nothing is allocated
        built = hf_causal_lm_from(build_empty(directory, gguf_file), model, moe, needs)
    return UpcycledHF(built, model.path, moe, tuple(model.moe_layers), on_meta=True)


def _check_vocabulary(hf_model: nn.Module, needs: TaskNeeds) -> None:
    from .hf.loading import input_embeddings

    vocab = input_embeddings(hf_model).num_embeddings
    if needs.num_outputs > vocab:
        raise ValueError(
            f"task.tokenizer ({needs.tokenizer!r}) has {needs.num_outputs} tokens, more than the "
            f"model's {vocab} embeddings: it is not this model's tokenizer"
        )


def hf_causal_lm_from(hf_model: nn.Module, model: ModelSection, moe: MoEConfig, needs: TaskNeeds) -> nn.Module:
    """A loaded (or freshly configured) transformers causal LM as the trainer's model: its blocks checked
    against model.num_layers, its vocabulary against the task's tokenizer, model.moe_layers upcycled,
    model.freeze applied (names as in the transformers model: 'model.embed_tokens', 'model.layers.0')."""
    from .hf import HFCausalLM, num_mlp_blocks, upcycle_hf

    num_blocks = num_mlp_blocks(hf_model)
    if model.num_layers != num_blocks:
        raise ValueError(
            f"model.num_layers ({model.num_layers}) != the {num_blocks} blocks of {type(hf_model).__name__} "
            f"at model.path ({model.path!r}); set model.num_layers = {num_blocks}"
        )
    _check_vocabulary(hf_model, needs)
    if model.moe_layers:
        upcycle_hf(hf_model, moe, layers=list(model.moe_layers))
    freeze_parameters(hf_model, model.freeze)
    return HFCausalLM(hf_model)


Builder = Callable[[ModelSection, MoEConfig, TaskNeeds], ModelSource]
BUILDERS: Dict[Tuple[str, str], Builder] = {
    ("token-classifier", "builtin"): _token_classifier,
    ("image-classifier", "builtin"): _image_classifier,
    ("minilm-classifier", "builtin"): _minilm_classifier,
    ("causal-lm", "hf"): _hf_causal_lm,
    ("causal-lm", "builtin"): _builtin_causal_lm,
}

# Kinds whose built-in model is made from model.dim / num_heads / ffn_dim (not loaded pre-trained).
BUILT_FROM_CONFIG = ("token-classifier", "image-classifier", "causal-lm")
