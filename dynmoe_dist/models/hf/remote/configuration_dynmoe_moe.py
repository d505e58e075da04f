"""Configuration of a transformers MoE model imported into DynMoE routing (top-any, top-k or top-p) and
exported by dynmoe_dist (loaded with ``trust_remote_code=True``).

Copied verbatim into the exported directory; imports only transformers. ``DynMoE<Stock>Config`` is the
family's config class ``<Stock>Config`` (``MixtralConfig``...) with model type ``dynmoe_`` + the family's
and the ``dynmoe`` section configuration_dynmoe.py describes (format 3): base_model_type is the family,
moe_blocks its sparse layers (the dense ones stay dense), block what its sparse block adds around the
routed experts. The classes are made on first use from the name config.json's auto_map asks for, so every
family transformers knows is served without a list here. The family's expert count field keeps the
checkpoint's count; the section's num_experts is what each MoE block holds now. A separate file from the
dense bases' so that their exports load with a transformers that predates these families.
"""

from typing import Any, Dict

import transformers

PREFIX, SUFFIX = "DynMoE", "Config"
_MADE: Dict[str, Any] = {}


def dynmoe_config_class(stock: Any) -> Any:
    """``stock`` (a transformers config class) with a model type of our own: transformers keys its auto
    classes by model type, and the stock type would let AutoModelForCausalLM build the stock model."""
    name = PREFIX + stock.__name__
    if name not in _MADE:
        _MADE[name] = type(name, (stock,), {"model_type": f"dynmoe_{stock.model_type}", "__module__": __name__})
    return _MADE[name]


def stock_class(module: str, name: str, suffix: str) -> Any:
    """The transformers class ``<Stock><suffix>`` that ``name`` (``DynMoE<Stock><suffix>``) asks ``module``
    for; AttributeError (what a missing module attribute raises) for any other name."""
    stock = getattr(transformers, name[len(PREFIX) :], None) if name.startswith(PREFIX) else None
    if stock is None or not name.endswith(suffix):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return stock


def __getattr__(name: str) -> Any:
    """``DynMoE<Stock>Config`` for any transformers config class ``<Stock>Config`` (PEP 562)."""
    return dynmoe_config_class(stock_class(__name__, name, SUFFIX))
