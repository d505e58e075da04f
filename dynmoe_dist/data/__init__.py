"""Token datasets that stream from disk: tokenise a corpus once, memory-map it on every rank.

``python -m dynmoe_dist.data prepare`` (or the first run) tokenises the corpus into the token cache
(data/cache.py); tasks/causal_lm.py opens it with ``open_corpus`` and reads only the windows of each
rank's micro-batches (data/windows.py).
"""

from .cache import TokenCorpus, default_cache_dir
from .prepare import CorpusSpec, open_corpus
from .windows import TokenWindows

__all__ = ["CorpusSpec", "TokenCorpus", "TokenWindows", "default_cache_dir", "open_corpus"]
