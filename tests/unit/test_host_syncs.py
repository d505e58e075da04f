"""Host reads of one training step stay within budget: one per MoE layer forward + a constant per step.

Counted on CPU by wrapping every call that would wait for the device under CUDA (item, tolist, cpu,
bool/int/float of a tensor, nonzero, bincount, unsized repeat_interleave, masked indexing; see
dynmoe_dist/bench/host_reads.py), keeping only calls made by dynmoe_dist code.

Budget per step, with L MoE layers and A micro-batches:
  L * A   routed_pairs reads the expert counts (the routed-row count is data dependent under top-any);
          the expert loop reuses them, so this is the only read per layer forward
  1       StepTotals.vector() (loss, accuracy, items, aux) to the host
  L       each layer's routing counts for telemetry (LayerRecorder.step_vector)
  1       the summed step metrics as Python floats
Gradient clipping adds one read (one fused norm); today GradSync.grad_norm makes one per parameter.
"""

import pytest
import torch

from dynmoe_dist.bench.host_reads import HostReadCounter
from dynmoe_dist.config import load_config
from dynmoe_dist.planning.stats import WindowStats
from dynmoe_dist.train.loop import Trainer

NUM_MOE_LAYERS, GRAD_ACCUM = 2, 2
TINY = [
    "task.name='synthetic'",
    "task.num_samples=96",
    "task.max_len=8",
    "model.dim=16",
    "model.num_heads=2",
    "model.ffn_dim=16",
    "model.num_layers=2",
    "model.moe_layers=[0, 1]",
    "train.global_batch_size=8",
    f"train.grad_accum={GRAD_ACCUM}",
    "moe.num_experts=3",
    "adaptive.enabled=false",
    "output.out_dir='/tmp/dynmoe_host_syncs'",
]


def budget(clip: bool) -> int:
    return NUM_MOE_LAYERS * GRAD_ACCUM + 1 + NUM_MOE_LAYERS + 1 + (1 if clip else 0)


def reads_of_one_step(*overrides) -> HostReadCounter:
    trainer = Trainer(load_config(None, TINY + list(overrides)))
    trainer.train_step()  # the first step builds optimizer state; count a steady-state one
    with HostReadCounter() as reads:
        trainer.train_step()
    return reads


@pytest.mark.parametrize("router", ["top_any", "top_k", "top_p"])
def test_one_step_without_clipping_holds_the_budget(router):
    reads = reads_of_one_step(f"moe.router='{router}'", "train.grad_clip=0")
    assert reads.count <= budget(clip=False), reads.by_site()
    per_forward = [site for kind, site in reads.calls if site.startswith("permute.py")]
    assert len(per_forward) == NUM_MOE_LAYERS * GRAD_ACCUM, reads.by_site()


def test_one_step_with_clipping_holds_the_budget():
    """grad_norm: one fused norm pass and one host read (the logged norm), not one per parameter."""
    reads = reads_of_one_step("train.grad_clip=1.0")
    assert reads.count <= budget(clip=True), reads.by_site()


def test_window_statistics_record_without_host_reads():
    stats = WindowStats.empty(num_experts=3, dim=4, max_experts=4)
    selected_TE = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    scores_TE = torch.tensor([[0.9, 0.1, 0.2], [0.1, 0.3, 0.2], [0.6, 0.7, 0.1]])
    x_TD = torch.arange(12.0).reshape(3, 4)
    with HostReadCounter() as reads:
        stats.add_tokens(selected_TE, scores_TE, x_TD)
    assert reads.count == 0, reads.by_site()
    # token 1 has k = 0 and is nearest to expert 1 (score 0.3)
    assert stats.counts_E.tolist() == [2.0, 1.0, 0.0]
    assert stats.num_unrouted_E.tolist() == [0.0, 1.0, 0.0]
    assert stats.unrouted_sum_ED[1].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert stats.unrouted_sum_ED[[0, 2]].abs().sum() == 0
    assert stats.k_hist_K.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_counter_sees_our_reads_and_restores_torch():
    t = torch.arange(4)
    original = torch.Tensor.tolist
    with HostReadCounter() as reads:
        t.tolist()
        torch.repeat_interleave(t, t)  # unsized: counted
        torch.repeat_interleave(t, t, output_size=6)  # sized: not counted
        t[t > 1]
    assert reads.count == 0  # calls from tests/ are not dynmoe_dist code
    assert torch.Tensor.tolist is original
    from dynmoe_dist.kernels.grouped_gemm import grouped_mm_reference

    from dynmoe_dist.moe.permute import count_values

    with HostReadCounter() as reads:
        count_values(t, 4)
        assert reads.count == 0
        grouped_mm_reference(torch.ones(3, 2), torch.ones(2, 2, 2), torch.tensor([1, 3]))
        assert [kind for kind, _ in reads.calls] == ["tolist", "tolist"]  # both in kernels/grouped_gemm.py
        _ = WindowStats.empty(2, 2, 2).num_tokens  # a property that reads its sum back (planning time)
    assert reads.calls[-1][0] == "__float__" and reads.calls[-1][1].startswith("stats.py")
