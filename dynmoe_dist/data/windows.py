"""Read packed training windows straight from the memory-mapped token file.

Shape legend: D documents in a split, B windows in a batch, W = L + 1 tokens per window.

A split is an ordered list of documents (a train/held-out split shuffles them). Its token stream is those
documents' tokens one after the other (each ends with EOS when the tokenizer has one), and window i is
stream[i*W : (i+1)*W]: exactly what an in-memory packing of that stream would cut, without building the
stream. ``read`` maps the stream positions of a batch to file positions with one searchsorted over the
split's cumulative document lengths and gathers them from the memmap, so a rank touches only the pages
of its own windows. Memory per split: two int64 per document (start in the file, cumulative length).
"""

from __future__ import annotations

import numpy as np


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens over the documents ``doc_ids_D`` of a token file, in that order."""

    def __init__(self, tokens: np.ndarray, doc_offsets: np.ndarray, doc_ids_D: np.ndarray, seq_len: int):
        doc_ids_D = np.asarray(doc_ids_D, dtype=np.int64)
        self.tokens = tokens
        self.width = seq_len + 1
        self.starts_D = np.asarray(doc_offsets[doc_ids_D], dtype=np.int64)
        lengths_D = np.asarray(doc_offsets[doc_ids_D + 1], dtype=np.int64) - self.starts_D
        self.cum_D1 = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths_D)])

    @property
    def num_tokens(self) -> int:
        return int(self.cum_D1[-1])

    def __len__(self) -> int:
        """Whole windows in the stream; the last partial one is dropped (as pack does)."""
        return self.num_tokens // self.width

    def read(self, indices_B: np.ndarray) -> np.ndarray:
        """(B, W) int64 tokens of windows indices_B."""
        indices_B = np.asarray(indices_B, dtype=np.int64)
        if indices_B.size and (indices_B.min() < 0 or indices_B.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)}): {indices_B.min()}..{indices_B.max()}")
        positions_BW = indices_B[:, None] * self.width + np.arange(self.width, dtype=np.int64)
        # the document holding each stream position: the last d with cum[d] <= position
        doc_BW = np.searchsorted(self.cum_D1, positions_BW, side="right") - 1
        file_positions_BW = self.starts_D[doc_BW] + (positions_BW - self.cum_D1[doc_BW])
        return self.tokens[file_positions_BW].astype(np.int64)
