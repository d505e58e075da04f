"""`--print-config` shows what runs: for an imported MoE, the values its config.json decides, each marked
with where it comes from and which value of the run file it overrides; the printed file reads back as the
same run."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_tiny import MOE_FFN, NUM_EXPERTS, NUM_LAYERS, corpus_lines, save_moe_checkpoint  # noqa: E402

from dynmoe_dist.train.cli import main  # noqa: E402


def printed(capsys, *args):
    assert main([*args, "--print-config"]) == 0
    return capsys.readouterr().out


def test_an_imported_moe_shows_its_own_sizes_kind_and_activation(tmp_path, capsys):
    directory, _ = save_moe_checkpoint("qwen3_moe", tmp_path / "qwen3")  # SiLU, gated, bias-free experts of 12
    (tmp_path / "c.txt").write_text("\n".join(corpus_lines()) + "\n")
    settings = ["task.name='causal-lm'", f"task.path='{tmp_path / 'c.txt'}'", "model.source='hf'"]
    settings += [f"model.path='{directory}'", "moe.activation='relu'"]  # the run file's choice, overridden
    out = printed(capsys, *[arg for setting in settings for arg in ("--set", setting)])
    for line in (
        'activation = "silu"  # from config.json (overrides "relu")',
        'expert_kind = "gated"  # from config.json (overrides "ffn")',
        "expert_bias = false  # from config.json (overrides true)",
        f"ffn_dim = {MOE_FFN}  # from config.json (overrides 128)",
        "dim = 16  # from config.json (overrides 64)",
        "num_heads = 2  # from config.json (overrides 4)",
        f"num_layers = {NUM_LAYERS}  # from config.json",
        "moe_layers = [1, 2]  # from config.json",  # Qwen3's mlp_only_layers = [0]: block 0 stays dense
        f"num_experts = {NUM_EXPERTS}  # from config.json",
    ):
        assert line + "\n" in out, line
    (tmp_path / "printed.toml").write_text(out)
    again = printed(capsys, "--config", str(tmp_path / "printed.toml"))
    assert values(again) == values(out)  # what is printed is what runs
    assert 'activation = "silu"  # from config.json\n' in again  # nothing left to override


def values(text):
    return [line.split("  #")[0] for line in text.splitlines()]


def test_a_builtin_run_has_nothing_to_mark(capsys):
    out = printed(capsys, "--config", "launcher/configs/demo.toml")
    assert "#" not in out and 'activation = "gelu"' in out
