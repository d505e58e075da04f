"""transformers models in and out: find the dense MLPs of a pre-trained model (one adapter per
architecture family), upcycle them into DynMoE layers, wrap the model for the trainer. Plain models:
no parallel code. Re-exported as ``dynmoe_dist.hf``."""

from .adapters import SUPPORTED, MLPSite, find_mlps
from .pretrained import from_pretrained
from .upcycle import MoEBlock, moe_blocks, num_mlp_blocks, upcycle_hf
from .wrappers import HFCausalLM

__all__ = [
    "SUPPORTED",
    "MLPSite",
    "find_mlps",
    "MoEBlock",
    "moe_blocks",
    "num_mlp_blocks",
    "upcycle_hf",
    "HFCausalLM",
    "from_pretrained",
]
