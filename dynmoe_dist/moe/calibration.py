"""Thresholds for a router converted to top-any from a pre-trained MoE, from routing statistics (pure math).

Shape legend: T tokens (of every rank together), E experts.

Top-any selects expert e for token t when cos(x_t, W_e) > G_e (sigmoid on both sides, scale 1). The
converted router's gate vectors W are the pre-trained router's rows; the thresholds are chosen so that
each expert keeps its share of the model's own routing on a sample of the user's data, scaled to a target
mean k: expert e is then chosen by the n_e tokens with the highest cosine, n_e = round(T * rate_e *
target_k / native_k), rate_e = the share of tokens the native rule sent to e. So the mean k starts at
target_k, the load is the model's own, and an expert the data never reaches under the native rule gets a
threshold above every token's cosine: the first adaptive window finds it unused and removes it.
Tokens with equal cosines (the same token in the same context) are chosen together or not at all, so the
sample's mean k matches the target up to such ties; an expert takes every token at most, so a target k
that would need more leaves the mean short of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

MARGIN = 1e-6
"""How far above the highest (below the lowest) cosine a never (always) chosen expert's threshold sits."""


def thresholds_for_counts(cos_TE: Tensor, counts_E: Tensor) -> Tensor:
    """(E,) thresholds G such that exactly counts_E[e] tokens have cos_TE[:, e] > G[e] (ties aside): midway
    between the counts_E[e]-th and the next highest cosine of expert e."""
    num_tokens = cos_TE.shape[0]
    sorted_TE = cos_TE.sort(dim=0, descending=True).values
    counts_E = counts_E.clamp(0, num_tokens).long()
    padded_TE = torch.cat(
        [sorted_TE[:1] + 2 * MARGIN, sorted_TE, sorted_TE[-1:] - 2 * MARGIN]
    )  # row 0: above the highest; row T + 1: below the lowest
    above_E = padded_TE.gather(0, counts_E.unsqueeze(0)).squeeze(0)  # the n-th highest (row 0 when n = 0)
    below_E = padded_TE.gather(0, (counts_E + 1).unsqueeze(0)).squeeze(0)  # the (n + 1)-th (row T + 1 when n = T)
    return (above_E + below_E) / 2


def calibrated_counts(native_counts_E: Tensor, num_tokens: int, native_k: int, target_k: float) -> Tensor:
    """Tokens each expert should take: its native count scaled from native_k to target_k experts per token,
    rounded so that the total is round(num_tokens * target_k), no expert above num_tokens."""
    want_E = native_counts_E.double() * (target_k / native_k)
    counts_E = want_E.floor()
    short = int(round(num_tokens * target_k) - counts_E.sum().item())
    if short > 0:  # largest remainders first, as in apportionment; never to an expert the data never reached
        order = (want_E - counts_E).argsort(descending=True, stable=True)
        order = order[want_E[order] > 0]
        counts_E[order[:short]] += 1
    return counts_E.clamp(max=num_tokens).long()
