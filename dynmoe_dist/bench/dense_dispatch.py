"""The DynMoE authors' dense T x E x C dispatch, rewritten here as the benchmark's comparison.

What their DeepSpeed-0.9.5 fork does for top-any gating (``topanygating_opt`` and ``MOELayer.forward``
in ``deepspeed/moe/sharded_moe.py``), step by step:

1. ``mask = gates.int()`` (gates are the 0/1 straight-through selections), ``exp_counts = mask.sum(0)``
   moved to the host; dropless capacity ``C = max_e exp_counts`` (all-reduced with MAX).
2. ``locations = cumsum(mask, 0)``; ``slot = (locations * mask - 1) % (C + 1)``: a selected pair gets
   its position in its expert's buffer, an unselected one the extra column C.
3. ``one_hot(slot, C + 1).float()`` (T x E x (C+1), built as int64 first), drop the last column;
   ``combine = einsum('se,sec->sec', gates / max(k, 1), one_hot)``; ``dispatch = combine.bool()``.
4. ``buffers = einsum('sec,sm->ecm', dispatch.type_as(x), x)``: every expert gets a C-row buffer,
   zero-padded up to the largest expert's count.
5. Every expert runs on its whole (C, D) buffer, padding included.
6. ``out = einsum('sec,ecm->sm', combine.type_as(x), expert_out)``.

Routing (the cosine gate, thresholds, straight-through estimator, 1/k weights) and the auxiliary
losses are the same math in both codes, so this module reuses the layer's router and loss: the
comparison isolates dispatch and expert compute. Shape legend: T tokens, D model dim, E experts,
C capacity (rows per expert buffer).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dynmoe_dist.moe import MoELayer
from dynmoe_dist.moe.routing import Routing


def dense_dispatch_tensors(routing: Routing) -> Tuple[Tensor, Tensor, int]:
    """(combine_TEC float with the combine weights, dispatch_TEC bool, capacity C), as the reference."""
    mask_TE = routing.mask.int()
    # NOTE: device-to-host sync (the reference moves exp_counts to the CPU to size the buffers)
    capacity = int(mask_TE.sum(dim=0).max())  # NOTE: device-to-host sync (the capacity sizes the buffers)
    locations_TE = torch.cumsum(mask_TE, dim=0)
    # Unselected pairs land in column C (``-1 % (C + 1)``), which is then cut off.
    slot_TE = (locations_TE * mask_TE - 1) % (capacity + 1)
    one_hot_TEC = F.one_hot(slot_TE.long(), num_classes=capacity + 1).float()[:, :, :-1]
    combine_TEC = torch.einsum("se,sec->sec", routing.weights, one_hot_TEC)
    return combine_TEC, combine_TEC.bool(), capacity


def dense_dispatch_forward(layer: MoELayer, x: Tensor) -> Tuple[Tensor, Tensor, int]:
    """The reference's MoE forward on ``layer``'s own router and experts: (output, aux_loss, C)."""
    x_TD = x.reshape(-1, layer.config.dim)
    routing = layer.router(x_TD, layer.training)
    combine_TEC, dispatch_TEC, capacity = dense_dispatch_tensors(routing)
    buffers_ECD = torch.einsum("sec,sm->ecm", dispatch_TEC.type_as(x_TD), x_TD)
    # All experts compute on their full padded buffers, as DeepSpeed's Experts module does.
    expert_out_ECD = torch.stack([expert(buffer_CD) for expert, buffer_CD in zip(layer.experts.experts, buffers_ECD)])
    out_TD = torch.einsum("sec,ecm->sm", combine_TEC.type_as(x_TD), expert_out_ECD)
    return out_TD.reshape(x.shape), layer.aux_loss(routing), capacity


def dense_dispatch_bytes(num_tokens: int, num_experts: int, capacity: int) -> int:
    """Rough peak of the T x E x C tensors (int64 one-hot, float one-hot, combine, dispatch as
    float, and the combine gradient): used to skip sizes the machine cannot hold."""
    elements = num_tokens * num_experts * (capacity + 1)
    return elements * (8 + 4 + 4 + 4 + 4 + 1)
