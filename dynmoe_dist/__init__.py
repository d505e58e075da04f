"""dynmoe_dist: distributed expert-parallel training of Dynamic Mixture-of-Experts models."""

from .moe import ExpertBank, FeedForward, MoEConfig, MoELayer, MoEOutput, Routing, upcycle

__version__ = "0.1.0"

__all__ = ["ExpertBank", "FeedForward", "MoEConfig", "MoELayer", "MoEOutput", "Routing", "upcycle"]
