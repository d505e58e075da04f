# Ray must keep 127.0.0.1 (not the machine's outward address): set before anything imports ray.
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Two cores: keep every test process single-threaded unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Token caches of the causal-lm tests (dynmoe_dist/data) go to a fresh directory, not ~/.cache; the
# subprocesses the tests start inherit it.
if "DYNMOE_TOKEN_CACHE" not in os.environ:
    import tempfile

    os.environ["DYNMOE_TOKEN_CACHE"] = tempfile.mkdtemp(prefix="dynmoe-token-cache-")

import torch  # noqa: E402

torch.set_num_threads(1)
