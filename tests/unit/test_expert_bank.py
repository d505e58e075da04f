"""ExpertBank / FeedForward details: compute-mode choice, a single expert, bias-free experts, dtypes."""

import pytest
import torch

from dynmoe_dist import FeedForward, MoEConfig
from dynmoe_dist.moe.experts import ExpertBank, autocast_rows, reference_forward, use_grouped_mm


def test_compute_mode_choice():
    rows = torch.zeros(2, 4)
    assert use_grouped_mm("grouped_mm", rows) is True
    assert use_grouped_mm("loop", rows) is False
    # 'auto' takes the fused kernel only on CUDA in bf16; on CPU it loops, in bf16 as in fp32.
    assert use_grouped_mm("auto", rows) is False
    assert use_grouped_mm("auto", rows.bfloat16()) is False


def test_bank_of_one_expert_computes_it():
    torch.manual_seed(0)
    cfg = MoEConfig(dim=4, ffn_dim=6, num_experts=1, expert_compute="loop")
    bank = ExpertBank.fresh(cfg, 1)
    for p in bank.parameters():
        torch.nn.init.normal_(p)
    rows = torch.randn(3, 4)
    out = bank(rows, torch.tensor([3]))
    assert out.abs().sum() > 0
    torch.testing.assert_close(out, bank.experts[0](rows))


@pytest.mark.parametrize("mode", ["loop", "grouped_mm"])
def test_bias_free_experts(mode):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=4, ffn_dim=8, num_experts=2, expert_bias=False, expert_compute=mode)
    bank = ExpertBank.fresh(cfg, 2)
    assert all(e.b_in is None and e.b_out is None for e in bank.experts)
    rows, counts = torch.randn(5, 4), torch.tensor([2, 3])
    torch.testing.assert_close(bank(rows, counts), reference_forward(list(bank.experts), rows, counts))


def test_feed_forward_computes_in_the_rows_dtype():
    torch.manual_seed(0)
    ffn = FeedForward(4, 8)  # fp32 master weights
    out = ffn(torch.randn(3, 4).bfloat16())
    assert out.dtype == torch.bfloat16 and ffn.w_in.dtype == torch.float32


def test_rows_take_the_autocast_dtype():
    rows = torch.randn(3, 4)
    assert autocast_rows(rows).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_rows(rows).dtype == torch.bfloat16


def test_grouped_mode_casts_fp32_weights_to_bf16_rows():
    # Under autocast the rows arrive in bf16 while the master weights stay fp32; the grouped path must
    # cast the stacked weights and biases to the rows' dtype, like the loop does.
    torch.manual_seed(0)
    cfg = MoEConfig(dim=4, ffn_dim=8, num_experts=2, expert_compute="grouped_mm")
    bank = ExpertBank.fresh(cfg, 2)
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=0.5)
    rows, counts = torch.randn(5, 4).bfloat16(), torch.tensor([2, 3])
    out = bank(rows, counts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference_forward(list(bank.experts), rows, counts), rtol=2e-2, atol=2e-2)


def test_no_rows_give_zeros_that_stay_in_the_graph():
    # A rank that receives no rows must still return an output with a grad_fn: its backward exchange
    # has to run (the other ranks wait for it).
    bank = ExpertBank.fresh(MoEConfig(dim=4, ffn_dim=8, num_experts=2, expert_compute="loop"), 2)
    rows = torch.zeros(0, 4, requires_grad=True)
    out = bank(rows, torch.tensor([0, 0]))
    assert out.shape == (0, 4) and out.requires_grad and out.grad_fn is not None


@pytest.mark.parametrize("mode, path", [("grouped_mm", "_grouped"), ("loop", "_loop")])
def test_the_configured_compute_mode_picks_the_path(mode, path, monkeypatch):
    bank = ExpertBank.fresh(MoEConfig(dim=4, ffn_dim=8, num_experts=2, expert_compute=mode), 2)
    taken = []
    for name in ("_grouped", "_loop"):
        real = getattr(bank, name)
        monkeypatch.setattr(
            bank,
            name,
            lambda rows, counts, *rest, real=real, name=name: taken.append(name) or real(rows, counts, *rest),
        )
    bank(torch.randn(3, 4), torch.tensor([1, 2]))
    assert taken == [path]


def test_new_experts_follow_the_config_and_init_normal_zero_mean():
    torch.manual_seed(0)
    cfg = MoEConfig(dim=64, ffn_dim=64, num_experts=1, activation="relu", init_std=0.5)
    (expert,) = ExpertBank.fresh(cfg, 1).experts
    assert expert.activation == "relu"
    for w in (expert.w_in.detach(), expert.w_out.detach()):  # 4096 samples each
        assert abs(float(w.mean())) < 0.05 and 0.45 < float(w.std()) < 0.55
    default = FeedForward(64, 64)
    assert 0.018 < float(default.w_in.detach().std()) < 0.022  # the default init_std is 0.02


def test_compute_mode_choice_on_cuda_takes_grouped_mm_for_bf16_only():
    # use_grouped_mm reads only the rows' device kind and dtype: stand-ins give the CUDA answers on CPU.
    class Rows:
        def __init__(self, is_cuda, dtype):
            self.is_cuda, self.dtype = is_cuda, dtype

    cuda_bf16, cuda_fp32 = Rows(True, torch.bfloat16), Rows(True, torch.float32)
    assert use_grouped_mm("auto", cuda_bf16) is True
    assert use_grouped_mm("auto", cuda_fp32) is False
    assert use_grouped_mm("loop", cuda_bf16) is False  # 'loop' is never overridden by 'auto'
    assert use_grouped_mm("grouped_mm", Rows(False, torch.float32)) is True


def _bank_and_calls(run_every_expert):
    # Three experts, counts [2, 0, 1]: rows 0-1 go to expert 0, none to expert 1, row 2 to expert 2.
    torch.manual_seed(0)
    bank = ExpertBank.fresh(MoEConfig(dim=4, ffn_dim=6, num_experts=3, expert_compute="loop"), 3)
    bank.run_every_expert = run_every_expert
    calls = []
    for i, expert in enumerate(bank.experts):
        expert.register_forward_hook(lambda m, args, out, i=i: calls.append((i, args[0].shape[0])))
    return bank, calls


@pytest.mark.parametrize("run_every_expert", [False, True])
def test_loop_calls_experts_without_rows_only_when_every_expert_must_run(run_every_expert):
    bank, calls = _bank_and_calls(run_every_expert)
    rows, counts = torch.randn(3, 4), torch.tensor([2, 0, 1])
    out = bank(rows, counts, (2, 0, 1))
    # (expert, rows it was called on): expert 1 has none and runs only when every expert must
    assert calls == ([(0, 2), (1, 0), (2, 1)] if run_every_expert else [(0, 2), (2, 1)])
    want = torch.cat([bank.experts[0](rows[:2]), bank.experts[2](rows[2:])])
    torch.testing.assert_close(out, want)
    # Without the sizes the loop reads the counts itself: the same output.
    torch.testing.assert_close(bank(rows, counts), want)


@pytest.mark.parametrize("run_every_expert", [False, True])
def test_loop_makes_no_host_read_when_the_sizes_are_given(run_every_expert):
    from dynmoe_dist.bench.host_reads import HostReadCounter

    bank, _ = _bank_and_calls(run_every_expert)
    rows, counts = torch.randn(3, 4), torch.tensor([2, 0, 1])

    def reads_in_experts(*sizes):
        with HostReadCounter() as reads:
            bank(rows, counts, *sizes)
        return [site for _, site in reads.calls if site.startswith("experts.py")]

    assert reads_in_experts((2, 0, 1)) == []
    assert len(reads_in_experts()) == 1  # the counts' tolist, once


def test_grouped_path_makes_no_host_read_of_its_own():
    # The slot of every row comes from repeat_interleave with the known row count: no sync.
    from dynmoe_dist.bench.host_reads import HostReadCounter

    torch.manual_seed(0)
    bank = ExpertBank.fresh(MoEConfig(dim=8, ffn_dim=16, num_experts=3, expert_compute="grouped_mm"), 3)
    rows, counts = torch.randn(5, 8), torch.tensor([2, 0, 3])
    with HostReadCounter() as reads:
        out = bank(rows, counts)
    assert [site for _, site in reads.calls if site.startswith("experts.py")] == []
    torch.testing.assert_close(out, reference_forward(list(bank.experts), rows, counts), rtol=1e-5, atol=1e-6)


def test_reference_forward_of_no_rows_is_empty():
    experts = [FeedForward(4, 6), FeedForward(4, 6)]
    out = reference_forward(experts, torch.zeros(0, 4), torch.tensor([0, 0]))
    assert out.shape == (0, 4)
