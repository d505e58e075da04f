"""A low-precision frozen base (lora.base_dtype 'bfloat16', 'nf4') under train.activation_checkpointing = 'block':
while the backward pass replays a block, no widened (float32) copy of its stored weights stays alive past the
matmul that used it (moe/frozen_base.linear_of: dense projections and every expert projection), and the adapters'
gradients are those of the same model without checkpointing. A control shows that the measure sees the copies a
plain ``F.linear(x, w.to(x.dtype))`` keeps for its backward."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dynmoe_dist.moe import frozen_base
from dynmoe_dist.moe.adapters import add_adapters
from dynmoe_dist.moe.experts import GatedFeedForward
from dynmoe_dist.parallel.blocks import apply_activation_checkpointing

pytest.importorskip("torchao")

DIM, HIDDEN, FFN, ROWS, BLOCKS = 64, 48, 32, 5, 3
STORED_PER_BLOCK = 5  # two dense projections, an expert's gate, up and down
WEIGHT_SHAPES = {(HIDDEN, DIM), (DIM, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)}  # no activation has one (ROWS rows)


def stored_linear(in_features: int, out_features: int, base_dtype: str) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False).requires_grad_(False)
    frozen_base.store(linear, "weight", base_dtype)
    frozen_base.upcast_forward(linear)
    return linear


class Block(nn.Module):
    """A dense projection, a LoRA expert and a projection back, every weight stored as ``base_dtype`` says."""

    def __init__(self, base_dtype: str):
        super().__init__()
        self.down = stored_linear(DIM, HIDDEN, base_dtype)
        self.expert = GatedFeedForward(HIDDEN, FFN)
        add_adapters(self.expert, rank=2, alpha=4.0, gated=True)
        for p in self.expert.parameters():
            if p.requires_grad:  # B starts at zero in a run; random here so every adapter gets a gradient
                nn.init.normal_(p, std=0.1)
        frozen_base.store_expert(self.expert, base_dtype)
        self.up = stored_linear(HIDDEN, DIM, base_dtype)

    def forward(self, x_RD: torch.Tensor) -> torch.Tensor:
        return x_RD + self.up(torch.tanh(self.expert(self.down(x_RD))))


class Stack(nn.Module):
    def __init__(self, base_dtype: str, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(base_dtype) for _ in range(BLOCKS))
        if checkpointed:
            apply_activation_checkpointing(self)

    def forward(self, x_RD: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_RD = block(x_RD)
        return x_RD


class WidenedCopies(TorchDispatchMode):
    """The most float32 tensors of a stored weight's shape alive at once (weak references: a tensor autograd keeps
    for the backward stays alive)."""

    def __init__(self):
        super().__init__()
        self.alive, self.most = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) in WEIGHT_SHAPES:
                self.alive.append(weakref.ref(t))
        self.alive = [ref for ref in self.alive if ref() is not None]
        self.most = max(self.most, len(self.alive))
        return out


def step(base_dtype: str, checkpointed: bool):
    """(the most widened copies alive at once during forward and backward, adapter name -> gradient)."""
    model = Stack(base_dtype, checkpointed)
    x_RD = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    with WidenedCopies() as copies:
        model(x_RD).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return copies.most, grads


@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_a_replayed_block_keeps_no_widened_weight_and_the_gradients_do_not_change(base_dtype):
    most, grads = step(base_dtype, checkpointed=True)
    assert most <= 2, f"{most} widened copies alive at once"  # the one a matmul uses (and its transpose)
    _, plain = step(base_dtype, checkpointed=False)
    assert grads.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_the_measure_sees_what_a_plain_matmul_keeps(monkeypatch):
    def widened_matmul(x, weight):
        return F.linear(x, weight.to(x.dtype))

    monkeypatch.setattr(frozen_base._FrozenStoredMatmul, "apply", widened_matmul)
    most, _ = step("bfloat16", checkpointed=True)
    assert most >= STORED_PER_BLOCK, most  # a replayed block keeps each of its widened weights for its backward
