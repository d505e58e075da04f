"""transformers models in and out: find the dense MLPs of a pre-trained model (one adapter per
architecture family), upcycle them into DynMoE layers, import the MoE families (Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V3, gpt-oss) with their own routing or top-any and write them back in their stock layout,
wrap the model for the trainer. Plain models: no parallel code. Re-exported as ``dynmoe_dist.hf``."""

from .adapters import SUPPORTED, MLPSite, find_mlps
from .families import SUPPORTED_MOE, family_of
from .moe_import import import_moe
from .pretrained import from_pretrained
from .stock_layout import save_stock
from .upcycle import MoEBlock, moe_blocks, num_mlp_blocks, upcycle_hf
from .wrappers import HFCausalLM

__all__ = [
    "SUPPORTED",
    "MLPSite",
    "find_mlps",
    "SUPPORTED_MOE",
    "family_of",
    "import_moe",
    "save_stock",
    "MoEBlock",
    "moe_blocks",
    "num_mlp_blocks",
    "upcycle_hf",
    "HFCausalLM",
    "from_pretrained",
]
