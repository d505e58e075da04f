"""experiments/drift.py: how far upcycled experts moved from the pre-trained MLP and from one another.

Hand-worked on small vectors, then on real checkpoints of a tiny upcycled LLaMA (tests/hf_tiny.py),
checked against the norms computed directly from the saved HF weights and the checkpoint files."""

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import hf_model_settings, write_tiny_run  # noqa: E402  (tests/hf_tiny.py)

from dynmoe_dist.config import load_config  # noqa: E402
from dynmoe_dist.experiments.drift import compare_table, layer_drift, main, run_drift  # noqa: E402
from dynmoe_dist.train.checkpoint import read_checkpoint_dense  # noqa: E402
from dynmoe_dist.train.checkpoint_parts import read_expert_file  # noqa: E402

QUIET = ["output.progress=false", "output.tensorboard=false", "output.report=false"]


def test_layer_drift_hand_worked():
    # |W0| = 5; expert a is the copy, b moved by (0, 5): drift 0 and 1; both sit 2.5 from their mean
    reference = {"w": torch.tensor([3.0, 4.0])}
    experts = [{"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([3.0, 9.0])}]
    got = layer_drift(reference, experts)
    assert got == {"experts": 2, "drift": 0.5, "drift_max": 1.0, "spread": 0.5, "spread_max": 0.5}
    # the bias is in the same norm: W0 = (b, w) = (1, 1, 0), the expert (2, 1, 1): |(1, 0, 1)| / |(1, 1, 0)| = 1;
    # a single expert has no spread
    two = layer_drift(
        {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])},
        [{"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0])}],
    )
    assert two["drift"] == pytest.approx(1.0) and two["spread"] == 0.0


def test_layer_drift_needs_the_same_parameters():
    with pytest.raises(
        ValueError, match=r"expert parameters \['w_in'\] do not match the pre-trained MLP's \['b_in', 'w_in'\]"
    ):
        layer_drift({"w_in": torch.ones(2), "b_in": torch.ones(1)}, [{"w_in": torch.ones(2)}])


def _train(root, model_dir, text_file, name, *extra):
    from dynmoe_dist.train.run import run

    out = root / "runs" / name / "seed0"
    settings = [*hf_model_settings(model_dir, text_file), "moe.num_experts=3", "train.global_batch_size=6"]
    config = load_config(
        None,
        [
            *settings,
            "train.max_steps=3",
            "train.lr=0.01",
            "adaptive.enabled=false",
            *QUIET,
            f"output.out_dir='{out}'",
            *extra,
        ],
    )
    run(config)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    model_dir, text_file = write_tiny_run(root / "tiny")
    moe = _train(root, model_dir, text_file, "moe")
    dense = _train(root, model_dir, text_file, "dense", "model.moe_layers=[]")
    return root, model_dir, moe, dense


def _pretrained_mlp(model_dir, block):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    return [weights[f"model.layers.{block}.mlp.{p}_proj.weight"].double() for p in ("gate", "up", "down")]


def _norm(tensors):
    return float(torch.cat([t.flatten() for t in tensors]).norm())


def test_moe_run_against_norms_of_the_saved_files(runs):
    root, model_dir, moe, _ = runs
    result = run_drift(moe)
    assert result["step"] == 3 and sorted(result["layers"]) == [1, 2]
    saved = read_expert_file(next((moe / "checkpoints").glob("step_*")), 0)
    for index, block in enumerate([1, 2]):
        w0 = _pretrained_mlp(model_dir, block)
        drifts, trained = [], []
        for e in range(3):
            p = saved[f"{index}/{e}"]["params"]
            mine = [p["w_gate"].double(), p["w_in"].double(), p["w_out"].double()]  # gate_proj, up_proj, down_proj
            trained.append(torch.cat([t.flatten() for t in mine]))
            drifts.append(_norm([a - b for a, b in zip(mine, w0)]) / _norm(w0))
        mean = torch.stack(trained).mean(0)
        spreads = [float((t - mean).norm()) / _norm(w0) for t in trained]
        layer = result["layers"][block]
        assert layer["experts"] == 3
        assert layer["drift"] == pytest.approx(sum(drifts) / 3, rel=1e-9) and layer["drift_max"] == pytest.approx(
            max(drifts), rel=1e-9
        )
        assert layer["spread"] == pytest.approx(sum(spreads) / 3, rel=1e-9)
        # trained at lr 0.01 for 3 steps: the experts moved, and apart (they saw different tokens)
        assert layer["drift"] > 1e-4 and layer["spread"] > 1e-6


def test_dense_run_compares_its_own_mlp(runs):
    root, model_dir, _, dense = runs
    result = run_drift(dense, blocks=[1])
    params = read_checkpoint_dense(next((dense / "checkpoints").glob("step_*")))
    trained = [params[f"hf.model.layers.1.mlp.{p}_proj.weight"].double() for p in ("gate", "up", "down")]
    w0 = _pretrained_mlp(model_dir, 1)
    expected = _norm([a - b for a, b in zip(trained, w0)]) / _norm(w0)
    assert result["layers"][1]["experts"] == 1 and result["layers"][1]["spread"] == 0.0
    assert result["layers"][1]["drift"] == pytest.approx(expected, rel=1e-9) and expected > 1e-4


def test_compare_table_has_a_row_per_model(runs, capsys):
    root = runs[0]
    rows = compare_table(root)
    assert rows[0].startswith("| model | seeds | drift") and len(rows) == 4
    dense_row, moe_row = rows[2].split(" | "), rows[3].split(" | ")
    assert dense_row[0] == "| dense" and dense_row[3] == "-" and dense_row[4] == "1.0 / 1.0 |"
    assert moe_row[0] == "| moe" and moe_row[4] == "3.0 / 3.0 |"
    expected = 100 * sum(layer["drift"] for layer in run_drift(runs[2])["layers"].values()) / 2
    assert moe_row[2] == f"{expected:.2f} ± 0.00"
    main(["--compare", str(root)])
    assert capsys.readouterr().out.splitlines() == rows


def test_cli_prints_json_lines_and_errors_name_the_input(runs, tmp_path, capsys):
    _, _, moe, dense = runs
    main([str(moe)])
    assert sorted(json.loads(capsys.readouterr().out)["layers"]) == ["1", "2"]
    for argv, message in [
        ([str(dense)], r"is a dense run: --blocks must name the MLP blocks"),
        ([str(moe), "--blocks", "0"], r"--blocks \(\[0\]\) must be the run's MoE blocks \(\[1, 2\]\)"),
        ([str(dense), "--blocks", "7"], r"block 7 is not one of the model's 3 MLP blocks"),
        ([str(tmp_path)], r"holds no complete checkpoint"),
        (["--blocks", "x", str(moe)], r"--blocks \('x'\) must be comma-separated integers"),
        ([], r"give RUN_DIRs or --compare DIR"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert re.search(message, capsys.readouterr().err), argv


def test_a_model_trained_from_scratch_has_no_pretrained_mlp(tmp_path, capsys):
    from dynmoe_dist.train.run import run

    out = tmp_path / "synthetic"
    config = load_config(
        None,
        ["task.name='synthetic'", "train.max_steps=1", "adaptive.enabled=false", *QUIET, f"output.out_dir='{out}'"],
    )
    run(config)
    with pytest.raises(
        ValueError, match=r"drift needs an upcycled pre-trained model; .*no dense MLP of a known architecture"
    ):
        run_drift(out)
