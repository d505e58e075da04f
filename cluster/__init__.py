"""dynmoe_dist.cluster: everything that touches Ray (the only package allowed to import it).

- ``coordinator``: the named plan actor (one per job) and the worker-side ``RayCoordinator``;
- ``submit``: the Ray job entry point (``python -m dynmoe_dist.cluster.submit``), Ray Train workers;
- ``local``: a local head on 127.0.0.1 for tests and ``launcher/ray_submit.sh --local``.

Importing this package does not import Ray; ``import_ray()`` does, with an install hint when it is missing.
"""

from __future__ import annotations

import importlib

RAY_INSTALL_HINT = "pip install -e '.[ray]' in the checkout"


class RayMissing(ImportError):
    """Ray (or Ray Train) is not installed; the message says which extra to install."""


def import_ray(module: str = "ray"):
    """Import ``ray`` or one of its submodules (e.g. 'ray.train.torch'), naming the extra when missing."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise RayMissing(
            f"{module} is not installed (needed to run with Ray): {RAY_INSTALL_HINT} [import error: {err}]"
        ) from err
