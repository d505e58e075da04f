"""Kernels (installed as dynmoe_dist.kernels), each next to the torch reference it must match."""

import sys

if __name__ == "kernels":
    # Imported bare: this folder is only ever dynmoe_dist.kernels (never `import kernels`, DESIGN.md), but
    # `python -m` from the checkout puts its root first on sys.path, where this folder shadows the PyPI
    # package of the same name, which transformers >= 5.25 requires and imports (Hugging Face's hub
    # kernels). Hand the importer that package, found on sys.path without the checkout's root. With none
    # installed this stays an empty module without a __version__, which transformers reads as "not
    # installed" (what older transformers, which only probe for it, see).
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    _root = Path(__file__).resolve().parent.parent
    _others = [p for p in sys.path if Path(p or ".").resolve() != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _others)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # what the import statement returns once this file has run
        _spec.loader.exec_module(_module)
else:
    from dynmoe_dist.kernels.grouped_gemm import grouped_mm, grouped_mm_reference, grouped_mm_supports

    __all__ = ["grouped_mm", "grouped_mm_reference", "grouped_mm_supports"]
