"""dynmoe_dist: distributed expert-parallel training of Dynamic Mixture-of-Experts models."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path


class _SiblingPackages(importlib.abc.MetaPathFinder):
    """The layout keeps kernels/ and cluster/ as top-level folders; an install puts them inside this
    package (pyproject's package-dir). In a plain source tree (a Ray ``--working-dir``, ``PYTHONPATH=.``,
    a GPU machine without an install) they sit beside it: map them to dynmoe_dist.kernels and
    dynmoe_dist.cluster, from the same tree as this package, before any other finder can pick a
    different tree's copy."""

    def __init__(self, locations):
        self.locations = locations

    def find_spec(self, fullname, path=None, target=None):
        folder = self.locations.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _map_sibling_packages() -> None:
    here = Path(__file__).resolve().parent
    locations = {
        f"{__name__}.{name}": here.parent / name
        for name in ("kernels", "cluster")
        if not (here / name).is_dir() and (here.parent / name / "__init__.py").is_file()
    }
    if locations and not any(isinstance(f, _SiblingPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingPackages(locations))


_map_sibling_packages()

from .moe import ExpertBank, FeedForward, MoEConfig, MoELayer, MoEOutput, Routing, upcycle  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ExpertBank", "FeedForward", "MoEConfig", "MoELayer", "MoEOutput", "Routing", "upcycle"]
