"""Short conversations packed into sequences of L positions, read straight from the memory-mapped token file.

Shape legend: D examples in a split, S packed sequences, B sequences in a batch, L = task.max_len positions.

An example of n tokens takes n - 1 positions: its inputs are its first n - 1 tokens, its targets its last
n - 1, a target kept where the token is the assistant's (data/chat.py's LOSS_BIT) and IGNORE elsewhere. The
examples of a split are packed in the split's order, next-fit: an example joins the current sequence when it
fits and starts the next one otherwise, so sequence s holds the split's examples [first_S1[s], first_S1[s+1])
and the plan costs one int64 per sequence. Positions restart at 0 with every example: from such position ids
transformers builds a block-diagonal causal mask (models/hf/wrappers.py), so no example attends to another and
each one's losses and gradients are those it has alone. A sequence's tail is padding: PAD_ID, IGNORE targets,
positions of its own from 0. An example longer than L + 1 tokens is dropped, not truncated (a cut would keep
a prompt and lose the answer the loss is about); the task says how many and which one first.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from .chat import unpack

IGNORE = -100
"""The target of a position that is not the assistant's: cross_entropy's ignore_index."""
PAD_ID = 0


def next_fit(positions_D: np.ndarray, capacity: int) -> np.ndarray:
    """(S + 1) offsets: sequence s holds examples [first[s], first[s + 1]); every example fits (<= capacity)."""
    first, used = [0], 0
    for i, positions in enumerate(positions_D.tolist()):
        if used + positions > capacity:
            first.append(i)
            used = 0
        used += positions
    if len(positions_D):
        first.append(len(positions_D))
    return np.asarray(first, dtype=np.int64)


class PackedExamples:
    """The examples ``doc_ids_D`` of a 'chat' token file, in that order, packed into sequences of seq_len."""

    def __init__(self, tokens, doc_offsets, loss_tokens, doc_ids_D, seq_len: int):
        doc_ids_D = np.asarray(doc_ids_D, dtype=np.int64)
        starts_D = np.asarray(doc_offsets[doc_ids_D], dtype=np.int64)
        positions_D = np.asarray(doc_offsets[doc_ids_D + 1], dtype=np.int64) - starts_D - 1
        fits_D = (positions_D >= 1) & (positions_D <= seq_len)
        self.dropped: List[int] = doc_ids_D[~fits_D].tolist()
        """Examples longer than seq_len + 1 tokens (or of one token: nothing to predict), by document id."""
        self.tokens, self.seq_len = tokens, seq_len
        self.starts_D, self.positions_D = starts_D[fits_D], positions_D[fits_D]
        self.first_S1 = next_fit(self.positions_D, seq_len)
        cum_loss = np.concatenate([[0], np.cumsum(np.asarray(loss_tokens[doc_ids_D[fits_D]], dtype=np.int64))])
        self.targets_S = cum_loss[self.first_S1[1:]] - cum_loss[self.first_S1[:-1]]
        """Assistant tokens (the loss's items) in each sequence."""

    def __len__(self) -> int:
        return len(self.first_S1) - 1

    @property
    def num_examples(self) -> int:
        return len(self.starts_D)

    def fill(self) -> float:
        """Share of the sequences' positions that hold an example (the rest is padding)."""
        return float(self.positions_D.sum()) / max(len(self) * self.seq_len, 1)

    def read(self, indices_B: np.ndarray) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
        """Sequences indices_B as the model's inputs (input_ids, position_ids, attention_mask: 1 on an example,
        0 on padding) and their targets, each (B, L) int64."""
        indices_B = np.asarray(indices_B, dtype=np.int64)
        if indices_B.size and (indices_B.min() < 0 or indices_B.max() >= len(self)):
            raise IndexError(f"sequence index out of range [0, {len(self)}): {indices_B.min()}..{indices_B.max()}")
        shape = (len(indices_B), self.seq_len)
        inputs_BL, targets_BL = np.full(shape, PAD_ID, dtype=np.int64), np.full(shape, IGNORE, dtype=np.int64)
        positions_BL, real_BL = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        for b, s in enumerate(indices_B.tolist()):
            used = 0
            for d in range(self.first_S1[s], self.first_S1[s + 1]):
                n = int(self.positions_D[d])
                ids, marked = unpack(np.asarray(self.tokens[self.starts_D[d] : self.starts_D[d] + n + 1]))
                inputs_BL[b, used : used + n] = ids[:-1]
                targets_BL[b, used : used + n] = np.where(marked[1:], ids[1:], IGNORE)
                positions_BL[b, used : used + n] = np.arange(n)
                used += n
            positions_BL[b, used:] = np.arange(self.seq_len - used)
            real_BL[b, :used] = 1
        inputs = {"input_ids": inputs_BL, "position_ids": positions_BL, "attention_mask": real_BL}
        return inputs, targets_BL
