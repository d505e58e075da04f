"""``dynmoe_dist.hf``: the public face of ``dynmoe_dist.models.hf`` (transformers models in and out)."""

from ..models.hf import *  # noqa: F401,F403
from ..models.hf import __all__  # noqa: F401
