"""QLoRA's frozen base: weights stored as 4-bit NormalFloat (NF4), dequantised per use in the compute dtype.

The format is QLoRA's (Dettmers et al. 2023) as torchtune keeps it: blocks of 64 weights, each 4-bit code an
index into the 16 NF4 levels, one int8 scale per block and those scales quantised again in blocks of up to 256
(one float32 factor per scale block: "double quantisation"), about 4.1 bits a weight.

The backend is torchao's ``NF4Tensor`` (``torchao.quantization.to_nf4``, the tensor torchtune's QLoRA uses),
not bitsandbytes: it is plain PyTorch, so it runs on the CPU as on a GPU (bitsandbytes' 4-bit layer is a
CUDA kernel first), it is a tensor subclass that stays an ``nn.Parameter`` where the weight was (the module,
its name and its forward hook are unchanged), ``.to(dtype)`` and ``F.linear`` dequantise it (the expert
kinds' forward already casts its weights per call, so an expert dequantises only its own weights, only while
it computes), and it implements FSDP2's all-gather hooks, so a sharded NF4 base gathers its 4-bit codes.

The expert bank's grouped matmul would stack (hence dequantise) every expert's weights at once: a bank of
NF4 experts runs its per-expert loop instead (``ExpertBank.forward`` asks ``holds_nf4``).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Iterable, List, Sequence, Tuple, cast

import torch.nn as nn
from torch import Tensor

BLOCK_SIZE = 64  # weights per absmax block (QLoRA's and torchtune's)
SCALER_BLOCK_SIZE = 256  # block scales per double-quantisation block, at most (fewer where a weight is small)
INSTALL = "pip install torchao==0.18.0 (or the project's [lora] extra)"
# The weights of every expert kind that NF4 stores (biases stay in the run's dtype, as in QLoRA).
EXPERT_WEIGHTS = ("w_gate", "w_in", "w_out")


def backend_available() -> bool:
    """Whether torchao (the NF4 backend) is installed."""
    return importlib.util.find_spec("torchao") is not None


def is_nf4(t: object) -> bool:
    if not backend_available():
        return False
    from torchao.quantization import NF4Tensor

    return isinstance(t, NF4Tensor)


# One weight NF4 stores: (its module, its parameter name there, its qualified name for messages).
Weight = Tuple[nn.Module, str, str]


def check_blocks(weights: Sequence[Weight]) -> None:
    """One-line ValueError for the first weight whose size is no multiple of the NF4 block (64)."""
    for module, attr, name in weights:
        weight = cast(Tensor, getattr(module, attr))
        if weight.numel() % BLOCK_SIZE:
            raise ValueError(
                f"lora.base_dtype ('nf4'): {name} {tuple(weight.shape)} has {weight.numel()} weights, "
                f"not a multiple of the NF4 block ({BLOCK_SIZE})"
            )


def to_nf4(weight: Tensor) -> Tensor:
    """``weight`` as an NF4Tensor: blocks of 64, their scales double-quantised in blocks of up to 256 (of a number
    that divides the block count: torchao needs it whole)."""
    from torchao.quantization import to_nf4 as torchao_to_nf4

    blocks = weight.numel() // BLOCK_SIZE
    quantized: Tensor = torchao_to_nf4(weight.detach().contiguous(), BLOCK_SIZE, math.gcd(blocks, SCALER_BLOCK_SIZE))
    return quantized


def quantize(weights: Sequence[Weight]) -> None:
    """Replace every weight by a frozen NF4 parameter of the same values (all checked before any changes)."""
    check_blocks(weights)
    for module, attr, _ in weights:
        setattr(module, attr, nn.Parameter(to_nf4(cast(Tensor, getattr(module, attr))), requires_grad=False))


def expert_weights(experts: Sequence[nn.Module], prefix: str) -> List[Weight]:
    """Every expert's weights (not its biases nor its adapters), for ``quantize``."""
    return [
        (expert, attr, f"{prefix}.{slot}.{attr}")
        for slot, expert in enumerate(experts)
        for attr in EXPERT_WEIGHTS
        if getattr(expert, attr, None) is not None
    ]


def holds_nf4(experts: Iterable[nn.Module]) -> bool:
    """Whether a bank's experts are stored NF4 (all of them or none: ``quantize_base`` does every bank whole)."""
    first = next(iter(experts), None)
    return is_nf4(getattr(first, "w_in", None))


def stored_bytes(t: Tensor) -> int:
    """Bytes a tensor holds: an NF4Tensor's codes, block scales, their factors and mean and its 16 levels."""
    if not is_nf4(t):
        return t.numel() * t.element_size()
    inner_names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return sum(stored_bytes(getattr(t, n)) for n in inner_names)


def check_backend() -> None:
    if not backend_available():
        raise ValueError(f"lora.base_dtype ('nf4') needs torchao, which is not installed: {INSTALL}")
