"""The tiny float64 training run the distributed tests share: synthetic task, 2 blocks both MoE with 5
experts (up to 8), adaptive events every `period` steps. Tests add what they vary."""


def tiny_run_overrides(ep_size, steps, *, period=6, expert_init="average"):
    return [
        "moe.num_experts=5",
        "moe.max_experts=8",
        f"parallel.ep_size={ep_size}",
        "train.precision='float64'",
        f"train.max_steps={steps}",
        "train.global_batch_size=12",
        "train.lr=0.003",
        "train.warmup_steps=2",
        "task.num_samples=300",
        "task.max_len=10",
        "model.dim=16",
        "model.num_heads=2",
        "model.ffn_dim=24",
        "model.num_layers=2",
        "model.moe_layers=[0, 1]",
        f"adaptive.period_steps={period}",
        f"adaptive.expert_init='{expert_init}'",
        "adaptive.replicate_factor=1.2",
    ]


def tweaked_trainer(config):
    """A Trainer whose first event both removes (layer 0's expert 1 never clears its threshold) and adds
    experts (layer 1's high thresholds leave tokens unrouted): resumes are checked across both kinds."""
    import torch

    from dynmoe_dist.train.loop import Trainer

    trainer = Trainer(config)
    with torch.no_grad():
        trainer.moe_layers[0].router.threshold[1] = 10.0  # removed at the first event
        trainer.moe_layers[1].router.threshold.fill_(0.35)  # unrouted tokens: experts are added
    return trainer
