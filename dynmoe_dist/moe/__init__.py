"""Pure single-process MoE math: routing, losses, experts, permutation, the layer, upcycling.

Never imports torch.distributed or ray (a test checks this).
"""

from .config import MoEConfig
from .experts import ExpertBank, FeedForward, GatedFeedForward
from .layer import LocalDispatcher, MoELayer, MoEOutput
from .routing import Routing
from .upcycle import upcycle

__all__ = [
    "MoEConfig",
    "ExpertBank",
    "FeedForward",
    "GatedFeedForward",
    "LocalDispatcher",
    "MoELayer",
    "MoEOutput",
    "Routing",
    "upcycle",
]
