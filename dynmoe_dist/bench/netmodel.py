"""An alpha-beta model of one variable-size all-to-all, and the traffic matrix routing counts imply.

Shape legend: W ranks of one ep group, E experts. ``send_WW[s, d]`` bytes rank s sends rank d in one
exchange (the diagonal stays on the rank and costs nothing).

Per rank and direction: t = alpha * (peers it exchanges with) + max(intra bytes / intra bandwidth,
inter bytes / inter bandwidth). NVLink and the NIC are separate links, so the two byte terms overlap;
messages to different peers on one link share it (they serialise). The exchange ends when the
slowest rank's send or receive side does: the time is the maximum over ranks and directions.
Ranks fill nodes in order (rank // gpus_per_node), as the ep group's consecutive ranks do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Sequence

import numpy as np


@dataclass(frozen=True)
class Network:
    inter_node_bytes_per_s: float = 25e9
    """Per GPU, to other nodes (one 200 Gb/s NIC per GPU)."""
    intra_node_bytes_per_s: float = 450e9
    """Per GPU, to GPUs of its node (NVLink)."""
    gpus_per_node: int = 8
    alpha_s: float = 10e-6
    """Latency per peer message (NCCL point-to-point setup and launch, order of 10 us)."""

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"network {name} ({value}) must be > 0")

    def to_dict(self) -> Dict:
        return asdict(self)


def _side_times(bytes_WW: np.ndarray, net: Network) -> np.ndarray:
    """Time of each rank's outgoing side for a matrix of [rank, peer] bytes (diagonal ignored)."""
    num_ranks = bytes_WW.shape[0]
    node_W = np.arange(num_ranks) // net.gpus_per_node
    same_node_WW = node_W[:, None] == node_W[None, :]
    off_WW = bytes_WW * (1 - np.eye(num_ranks))
    intra_W = (off_WW * same_node_WW).sum(axis=1)
    inter_W = (off_WW * ~same_node_WW).sum(axis=1)
    peers_W = (off_WW > 0).sum(axis=1)
    return net.alpha_s * peers_W + np.maximum(
        intra_W / net.intra_node_bytes_per_s, inter_W / net.inter_node_bytes_per_s
    )


def all_to_all_time(send_WW: np.ndarray, net: Network) -> Dict:
    """Seconds of one exchange, and the bytes that decide it."""
    send_WW = np.asarray(send_WW, dtype=np.float64)
    if send_WW.ndim != 2 or send_WW.shape[0] != send_WW.shape[1]:
        raise ValueError(f"send matrix shape ({send_WW.shape}) must be (W, W)")
    off_WW = send_WW * (1 - np.eye(send_WW.shape[0]))
    send_t, recv_t = _side_times(send_WW, net), _side_times(send_WW.T, net)
    return {
        "time_s": float(max(send_t.max(), recv_t.max())),
        "max_send_bytes": float(off_WW.sum(axis=1).max()),
        "max_recv_bytes": float(off_WW.sum(axis=0).max()),
        "mean_send_bytes": float(off_WW.sum(axis=1).mean()),
    }


def rows_to_ranks(shares_E: Sequence[float], replicas: Sequence[Sequence[int]], num_ranks: int) -> np.ndarray:
    """Fraction of a source rank's routed rows that goes to each rank: expert e's share p_e split
    evenly over its replicas (the dispatcher's contiguous near-equal split)."""
    to_W = np.zeros(num_ranks)
    for share, holders in zip(shares_E, replicas):
        for rank in holders:
            to_W[rank] += share / len(holders)
    return to_W


def send_matrix(
    shares_E: Sequence[float], replicas: Sequence[Sequence[int]], num_ranks: int, rows_per_rank: float, row_bytes: float
) -> np.ndarray:
    """send_WW[s, d] for ranks that all route like the recorded totals (the same shares everywhere)."""
    to_W = rows_to_ranks(shares_E, replicas, num_ranks)
    return np.tile(to_W * rows_per_rank * row_bytes, (num_ranks, 1))
