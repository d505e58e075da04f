"""bench lora: the ratios against the full finetune and against PEFT, and activation checkpointing's effect
(hand-worked, skipped cases carried through), a case the config refuses reported with its one-line reason, bad
options as one line before anything starts, and a tiny run of the whole benchmark under both activation
checkpointing settings (slow: 6 spawned processes importing transformers and PEFT)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from dynmoe_dist.bench import lora as bench  # noqa: E402
from dynmoe_dist.bench.lora_cases import CASES, refusal, run_overrides, summarize  # noqa: E402
from dynmoe_dist.bench.lora_peft import compare_peft  # noqa: E402
from dynmoe_dist.bench.moe_checkpoint import write_checkpoint  # noqa: E402
from dynmoe_dist.moe import nf4  # noqa: E402


def _rank(wall, peak, trainable=10, loss=1.0):
    return {
        "wall": wall,
        "cpu": wall,
        "first_loss": loss,
        "held_mib": peak / 2,
        "peak_mib": peak,
        "parameters": 100,
        "trainable_parameters": trainable,
        "trainable_tensors": 2,
        "adapter_tensors": 2,
        "optimizer_state_tensors": 2,
        "checkpointed_blocks": 0,
    }


def test_a_case_takes_the_slowest_rank_per_step_and_the_largest_rank_memory():
    # wall per step: max(0.2, 0.3) = 0.3, max(0.5, 0.4) = 0.5, max(0.4, 0.1) = 0.4 -> median 0.4, min 0.3
    case = summarize([_rank([0.2, 0.5, 0.4], 100.0, loss=1.25), _rank([0.3, 0.4, 0.1], 120.0, trainable=12, loss=1.5)])
    assert (case["step_s_median"], case["step_s_min"], case["first_loss"]) == (0.4, 0.3, 2.75)
    assert case["peak_mib_per_rank"] == 120.0 and case["held_mib_per_rank"] == 60.0
    assert case["trainable_parameters_by_rank"] == [10, 12] and case["ranks"] == 2


def test_ratios_against_the_full_finetune_carry_the_targets_and_skipped_cases():
    cases = {
        "full": {"peak_mib_per_rank": 1000.0, "step_s_median": 2.0},
        "lora": {"peak_mib_per_rank": 400.0, "step_s_median": 2.2},
        "lora_bf16": {"peak_mib_per_rank": 300.0, "step_s_median": 1.5},
        "qlora": {"skipped": "lora.base_dtype ('nf4'): not yet"},
    }
    out = bench.against_full(cases)
    assert out["lora"]["peak"] == {"ratio": 0.4, "target": None, "meets_target": None}  # no memory target
    assert out["lora"]["step_time"] == {"ratio": 1.1, "target": 1.0, "meets_target": False}
    assert out["lora_bf16"]["peak"] == {"ratio": 0.3, "target": 0.35, "meets_target": True}
    assert out["lora_bf16"]["step_time"]["meets_target"] is True
    assert out["qlora"] == {"skipped": "lora.base_dtype ('nf4'): not yet"}
    assert set(out) == set(CASES) - {"full"}
    # judged on the exact ratio: 350.5 / 1000 prints as 0.35 (3 decimals) but is above the 0.35 target
    above = bench.against_full({**cases, "lora_bf16": {"peak_mib_per_rank": 350.5, "step_s_median": 1.5}})
    assert above["lora_bf16"]["peak"] == {"ratio": 0.35, "target": 0.35, "meets_target": False}
    assert bench.against_full({**cases, "full": {"skipped": "no"}})["lora"] == {"skipped": "no"}


def test_checkpointing_effect_is_block_over_none_for_every_side_measured_under_both():
    def measured(full_peak, qlora, ours_s):
        cases = {"full": {"peak_mib_per_rank": full_peak, "step_s_median": 2.0}, "qlora": qlora}
        peft = {"ours": {"peak_mib_per_rank": 100.0, "step_s_median": ours_s}, "peft": {"skipped": "no"}}
        return {"cases": cases, "peft": peft}

    plain = measured(1000.0, {"peak_mib_per_rank": 300.0, "step_s_median": 1.0}, 0.5)
    checkpointed = measured(800.0, {"skipped": "no torchao"}, 0.6)
    out = bench.checkpointing_effect({"none": plain, "block": checkpointed})
    assert set(out) == {"full", "peft.ours"}  # a side skipped under either setting has no ratio
    assert out["full"]["peak"] == {"ratio": 0.8, "target": None, "meets_target": None}
    assert out["full"]["step_time"]["ratio"] == 1.0 and out["peft.ours"]["step_time"]["ratio"] == 1.2
    assert bench.checkpointing_effect({"block": checkpointed}) == {}


def test_every_case_runs_with_the_setting_asked_for(tiny):
    from dynmoe_dist.config import load_config

    for checkpointing in ("none", "block"):
        for base_dtype in CASES.values():
            config = load_config(None, run_overrides(tiny, 2, base_dtype, 4, 8.0, checkpointing))
            assert config.train.activation_checkpointing == checkpointing
    assert bench.CHECKPOINTING == {"none": ("none",), "block": ("block",), "both": ("none", "block")}


def test_ours_over_peft_with_the_targets():
    peft = {"peak_mib_per_rank": 200.0, "step_s_median": 0.5, "first_loss": 4.0, "trainable_parameters_by_rank": [7]}
    ours = {"peak_mib_per_rank": 150.0, "step_s_median": 0.6, "first_loss": 4.0004, "trainable_parameters_by_rank": [7]}
    out = compare_peft({"ours": ours, "peft": peft})
    assert out["peak"] == {"ratio": 0.75, "target": 1.0, "meets_target": True}
    assert out["step_time"] == {"ratio": 1.2, "target": 1.0, "meets_target": False}
    assert out["first_loss_relative_difference"] == pytest.approx(1e-4) and out["same_trainable_parameters"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    write_checkpoint(directory, bench.TINY, max_shard_bytes=1 << 20)
    return str(directory)


def test_a_case_the_config_refuses_is_its_one_line_reason(tiny):
    assert refusal(run_overrides(tiny, 2, None, 4, 8.0)) is None  # the full finetune
    assert refusal(run_overrides(tiny, 2, "run", 4, 8.0)) is None
    reason = refusal(run_overrides(tiny, 2, "float8", 4, 8.0))
    assert reason is not None and "lora.base_dtype ('float8')" in reason and "\n" not in reason


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experts", "1"], "--experts (1) must be >= 2"),
        (["--tiny", "--rank", "40"], "--rank (40) must be <= the smallest adapted dimension (32)"),
        (["--tiny", "--batch", "3"], "--batch (3) must be even"),
        (["--dim", "500", "--heads", "8"], "--dim (500) must be a multiple of --heads (8)"),
        (["--tiny", "--steps", "0"], "--steps (0) must be > 0"),
        (["--top-k", "20"], "--top-k (20) must be <= --experts (16)"),
    ],
)
def test_bad_options_are_one_line_before_anything_starts(argv, message, monkeypatch):
    monkeypatch.setattr(bench, "write_checkpoint", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_checkpointing_setting_is_refused_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(bench, "write_checkpoint", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--activation-checkpointing", "full"])
    assert "--activation-checkpointing: invalid choice: 'full'" in capsys.readouterr().err


@pytest.mark.slow  # per setting two gloo ranks, then one process with PEFT, each importing transformers: ~140 s
def test_tiny_run_measures_every_accepted_case_under_both_settings_and_trains_only_adapters(tmp_path, capsys):
    out = tmp_path / "lora.json"
    bench.main(["--tiny", "--steps", "1", "--out", str(out)])  # the default: both settings
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["world"] == 2 and result["ep_size"] == 2
    assert result["activation_checkpointing"] == list(result["settings"]) == ["none", "block"]
    for setting, measured in result["settings"].items():
        _setting_measured(measured, bench.TINY.num_layers if setting == "block" else 0)
    plain, checkpointed = (result["settings"][s] for s in ("none", "block"))
    for name, case in checkpointed["cases"].items():  # recomputing changes no number of the forward
        if "skipped" not in case:
            assert case["first_loss"] == pytest.approx(plain["cases"][name]["first_loss"], rel=1e-6), name
            assert result["checkpointing_effect"][name]["peak"]["ratio"] == round(
                case["peak_mib_per_rank"] / plain["cases"][name]["peak_mib_per_rank"], 3
            )
    assert {"full", "lora", "peft.ours", "peft.peft"} <= set(result["checkpointing_effect"])


def _setting_measured(result, checkpointed_blocks):
    """One setting's cases and PEFT comparison, every side's blocks checkpointed as the setting says."""
    assert set(result["cases"]) == set(CASES)
    full = result["cases"]["full"]
    assert full["trainable_parameters_by_rank"] == full["parameters_by_rank"]  # every weight trains
    measured = {name: case for name, case in result["cases"].items() if "skipped" not in case}
    assert set(measured) == set(CASES) - (set() if nf4.backend_available() else {"qlora"})
    frozen = [measured[name]["frozen_parameters_mib_per_rank"] for name in measured if name != "full"]
    assert frozen == sorted(frozen, reverse=True) and len(set(frozen)) == len(frozen)  # run dtype > bf16 > NF4
    for name, case in result["cases"].items():
        if "skipped" in case:  # refused by the config (NF4 without torchao): its one line, no ratios
            assert "lora.base_dtype" in case["skipped"] and result["against_full"][name] == case
            continue
        assert case["ranks"] == 2 and case["step_s_median"] > 0 and case["peak_mib_per_rank"] > 0
        assert case["optimizer_state_tensors_by_rank"] == case["trainable_tensors_by_rank"]
        assert case["checkpointed_blocks_by_rank"] == [checkpointed_blocks] * 2, name
        if name != "full":
            _trains_only_adapters(case)
            ratios = result["against_full"][name]
            assert ratios["peak"]["ratio"] == round(case["peak_mib_per_rank"] / full["peak_mib_per_rank"], 3)
            assert ratios["step_time"]["ratio"] == round(case["step_s_median"] / full["step_s_median"], 3)
    peft = result["peft"]
    _trains_only_adapters(peft["ours"])
    assert peft["peft"]["experts_implementation"] == "grouped_mm" and peft["threads"] == 2
    assert peft["peft"]["optimizer_state_tensors_by_rank"] == peft["peft"]["trainable_tensors_by_rank"]
    assert peft["ours"]["checkpointed_blocks_by_rank"] == peft["peft"]["checkpointed_blocks_by_rank"]
    assert peft["ours"]["checkpointed_blocks_by_rank"] == [checkpointed_blocks]
    against = result["against_peft"]
    assert against["same_trainable_parameters"] and against["first_loss_relative_difference"] < 1e-5  # B = 0
    assert against["peak"]["ratio"] == round(peft["ours"]["peak_mib_per_rank"] / peft["peft"]["peak_mib_per_rank"], 3)
    assert isinstance(against["step_time"]["meets_target"], bool)


def _trains_only_adapters(case):
    assert case["trainable_tensors_by_rank"] == case["adapter_tensors_by_rank"]  # nothing else trains
    assert case["optimizer_state_tensors_by_rank"] == case["adapter_tensors_by_rank"]  # nothing else has AdamW state
    assert all(t < p for t, p in zip(case["trainable_parameters_by_rank"], case["parameters_by_rank"]))


def test_the_machine_record_names_the_allocator_settings(monkeypatch):
    """A CPU run's resident peak depends on glibc's allocator settings (MALLOC_MMAP_THRESHOLD_ returns freed
    blocks at once): every benchmark's machine record says which were set."""
    from dynmoe_dist.bench.measure import machine_info

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert machine_info(2)["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert "MALLOC_MMAP_THRESHOLD_" not in machine_info(2)["malloc_env"]
