"""The tiny `dynmoe-train` run the CLI tests share, as command-line arguments."""


def tiny_cli_args(num_samples, max_steps, *extra):
    settings = [
        f"task.num_samples={num_samples}",
        "task.max_len=8",
        "model.dim=16",
        "model.num_heads=2",
        "model.ffn_dim=16",
        "train.global_batch_size=8",
        f"train.max_steps={max_steps}",
        *extra,
        "output.progress=false",
        "output.tensorboard=false",
        "output.report=false",
    ]
    return [arg for setting in settings for arg in ("--set", setting)]
