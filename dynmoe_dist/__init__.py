"""dynmoe_dist: distributed expert-parallel training of Dynamic Mixture-of-Experts models."""

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path


class _SiblingPackages(importlib.abc.MetaPathFinder):
    """The layout keeps kernels/ and cluster/ as top-level folders; an install puts them inside this
    package (pyproject's package-dir). In a plain source tree (a Ray ``--working-dir``, ``PYTHONPATH=.``,
    a GPU machine without an install) and under an editable install they sit beside it: map them to
    dynmoe_dist.kernels and dynmoe_dist.cluster, from the same tree as this package, before any other
    finder can pick a different tree's copy.

    kernels/ has no ``__init__.py`` on purpose: a folder without one is only a namespace-package candidate,
    and loses a bare ``import kernels`` to a regular package of that name found anywhere on sys.path
    (Hugging Face's, which transformers >= 5.25 imports), even when ``python -m`` puts the checkout's root
    first. Here it is mapped as a package whose modules are its files and which runs no code of its own."""

    def __init__(self, locations):
        self.locations = locations

    def find_spec(self, fullname, path=None, target=None):
        folder = self.locations.get(fullname)
        if folder is None:
            return None
        init = folder / "__init__.py"
        if not init.is_file():  # a package without code: its files are its modules
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])


# The top-level folders mapped into this package, each with a file that tells it is this project's folder.
_SIBLINGS = {"kernels": "grouped_gemm.py", "cluster": "__init__.py"}


def _map_sibling_packages() -> None:
    here = Path(__file__).resolve().parent
    locations = {
        f"{__name__}.{name}": here.parent / name
        for name, marker in _SIBLINGS.items()
        if not (here / name).is_dir() and (here.parent / name / marker).is_file()
    }
    if locations and not any(isinstance(f, _SiblingPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _SiblingPackages(locations))


_map_sibling_packages()


class _DropMessages(logging.Filter):
    """Drops log records whose message contains one of ``parts`` (third-party noise with nothing to act on)."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(part in message for part in self.parts)


def _quiet_torchao_import() -> None:
    """transformers imports torchao (the QLoRA backend, moe/nf4.py) wherever it is installed, and on a CPU build
    of torch that import logs four lines in every process: its CUDA extensions failed to load, and torch's
    deprecation of registering two of its Enums. Nothing there is for a user of this project to act on."""
    logging.getLogger("torchao").addFilter(_DropMessages("Failed to load"))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("is an Enum subclass and is now natively"))


_quiet_torchao_import()

from .moe import ExpertBank, FeedForward, MoEConfig, MoELayer, MoEOutput, Routing, upcycle  # noqa: E402

__version__ = "0.1.0"

__all__ = ["ExpertBank", "FeedForward", "MoEConfig", "MoELayer", "MoEOutput", "Routing", "upcycle"]
