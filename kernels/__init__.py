"""Kernels (installed as dynmoe_dist.kernels), each next to the torch reference it must match."""

from dynmoe_dist.kernels.grouped_gemm import grouped_mm, grouped_mm_reference, grouped_mm_supports

__all__ = ["grouped_mm", "grouped_mm_reference", "grouped_mm_supports"]
