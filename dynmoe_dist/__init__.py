"""dynmoe_dist: distributed expert-parallel training of Dynamic Mixture-of-Experts models."""


def _map_checkout_kernels() -> None:
    """Run from a plain checkout (``PYTHONPATH=.``, nothing installed), as on a GPU machine without
    network or setuptools: pyproject's package-dir maps kernels/ to dynmoe_dist.kernels at install
    time; here the same one mapping is made by hand, and only when no installed copy provides it.
    (Appending the checkout root to ``__path__`` instead would also expose tests/, launcher/ ... as
    dynmoe_dist subpackages.) cluster/ is Ray-only and always installed, so it is not mapped."""
    import importlib.util
    import sys
    from pathlib import Path

    if importlib.util.find_spec(__name__ + ".kernels") is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.util.spec_from_file_location(__name__ + ".kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None:
        return  # not a checkout either: the import below reports the missing package
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module  # what the import system does for a submodule it loads


_map_checkout_kernels()

from .moe import ExpertBank, FeedForward, MoEConfig, MoELayer, MoEOutput, Routing, upcycle  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ExpertBank", "FeedForward", "MoEConfig", "MoELayer", "MoEOutput", "Routing", "upcycle"]
