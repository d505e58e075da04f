"""pretrain-moe's model, step count and option checks (the run itself: tests/distributed/test_moe_experiment.py)."""

import json

import pytest
import torch

from dynmoe_dist.experiments import pretrain_moe


def test_the_full_model_is_the_documented_qwen3_moe():
    from transformers import Qwen3MoeForCausalLM

    config = pretrain_moe.qwen3_moe_config(pretrain_moe.FULL, 8192, eos_id=0)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (16, 2, True)
    assert config.output_router_logits and config.router_aux_loss_coef == 0.01
    assert (config.num_hidden_layers, config.hidden_size, config.moe_intermediate_size) == (4, 256, 256)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # every block sparse
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (8192, 0, 0)
    with torch.device("meta"):  # shapes only
        model = Qwen3MoeForCausalLM(config)
    # the module comment's 17.6M: embeddings and head 2 x 8192 x 256, per block attention 256 x (256 + 2 x 128
    # + 256), 16 experts of 3 x 256 x 256, a router 16 x 256 and 4 norms
    assert sum(p.numel() for p in model.parameters()) == 17_582_848
    assert pretrain_moe.qwen3_moe_config(pretrain_moe.FULL, 8000, eos_id=0).vocab_size == 8000


def test_steps_from_the_time_budget():
    assert pretrain_moe.steps_for(12, 1.5) == 480  # 720 s / 1.5 s
    assert pretrain_moe.steps_for(0.001, 10.0) == 1  # at least one
    with pytest.raises(ValueError, match=r"--minutes \(0\) must be > 0"):
        pretrain_moe.steps_for(0, 1.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--minutes", "0"], r"--minutes \(0.0\) must be > 0"),
        (["--steps", "-1"], r"--steps \(-1\) must be >= 0 \(0 = from --minutes\)"),
    ],
)
def test_bad_options_are_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_moe.main([*argv, "--out", str(tmp_path / "model")], prog="pretrain-moe")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("pretrain-moe: error: ")
    assert __import__("re").search(message, err)


def test_an_out_that_holds_another_model_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as exit_info:
        pretrain_moe.main(["--tiny", "--out", str(tmp_path)], prog="pretrain-moe")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "holds a model pre-trained with other settings" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "pretrain").exists()  # refused before anything was written


def test_settings_compare_equal_after_a_json_round_trip():
    args = pretrain_moe.parser("pretrain-moe").parse_args(["--tiny"])
    wanted = pretrain_moe.settings(args, pretrain_moe.TINY)
    assert json.loads(json.dumps(wanted)) == wanted  # the tiny sizes hold a tuple of stdlib folders


def test_the_commands_helpers(tmp_path):
    from dynmoe_dist.bench import commands
    from dynmoe_dist.experiments import moe_runs

    assert commands.last_json('progress\n{"a": 1}\n{"b": 2}\nwrote it\n') == {"b": 2}
    with pytest.raises(commands.CommandFailed, match="no JSON line"):
        commands.last_json("nothing here\n")
    # a failing command: its exit status and the last lines of its stderr, in one line
    with pytest.raises(commands.CommandFailed, match=r"python -m json.tool .* exited 2: .*No such file"):
        commands.run_command(["json.tool", str(tmp_path / "missing.json")], {})
    assert moe_runs.simulated(lambda a, b: a + b, 1, (2, 3)) == [5]  # one rank: in this process
