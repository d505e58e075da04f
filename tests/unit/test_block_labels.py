"""MoE layers are labelled by the model's block index wherever a user reads them (event lines, TensorBoard
tags, the report), as model.moe_layers numbers them; runs logged before the labels keep positions."""

import pytest
from test_telemetry import step_record

from dynmoe_dist.moe.layer import block_index, block_labels
from dynmoe_dist.train import report
from dynmoe_dist.train.report import report_series
from dynmoe_dist.train.telemetry import describe_event, scalar_tags


@pytest.mark.parametrize(
    "name, block",
    [
        ("stack.blocks.1.ffn", 1),  # the built-in transformer
        ("hf.model.layers.4.mlp.moe", 4),  # an upcycled transformers causal LM
        ("bert.encoder.layer.5.intermediate.moe", 5),  # MiniLM
        ("model.layers.12.block_sparse_moe", 12),
        ("", None),  # the model is the layer itself
        ("moe", None),
    ],
)
def test_block_index_is_the_first_integer_path_component(name, block):
    assert block_index(name) == block


def test_block_labels_fall_back_to_positions_when_blocks_are_missing_or_shared():
    assert block_labels(["hf.model.layers.4.mlp.moe", "hf.model.layers.5.mlp.moe"]) == [4, 5]
    assert block_labels(["", "x.3.moe"]) == [0, 1]  # one layer has no block: positions for all
    assert block_labels(["b.2.attn.moe", "b.2.ffn.moe"]) == [0, 1]  # two MoE layers in block 2


STEP = step_record(7, [4, 6], [[1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], blocks=[4, 5], loss=1.0)
EVENT = {
    "kind": "event",
    "step": 7,
    "layer": 1,
    "block": 5,
    "removed": [],
    "added": [{"expert": 5, "init": "reuse_discarded->average"}],
    "moves": 4,
    "replicas": {},
    "imbalance_before": 1.03,
    "imbalance_unmoved": 1.10,
    "imbalance_after": 1.02,
    "num_experts": 6,
}


def test_event_line_names_the_block_and_shows_measured_and_planned_imbalance():
    assert describe_event(EVENT) == (
        "step 7 block 5: added 5 (reuse_discarded->average); 4 moves; "
        "imbalance measured 1.03, planned 1.10 -> 1.02 by the moves; 6 experts"
    )
    unmoved = {**EVENT, "moves": 0, "imbalance_after": 1.10}
    assert "imbalance measured 1.03, planned 1.10; 6 experts" in describe_event(unmoved)
    old = {k: v for k, v in EVENT.items() if k not in ("block", "imbalance_unmoved")}  # an older run's record
    assert describe_event(old).startswith("step 7 layer 1: ") and "imbalance 1.03 -> 1.02" in describe_event(old)


def test_tensorboard_tags_use_blocks():
    tags = scalar_tags(STEP)
    assert tags["moe/block5/num_experts"] == 6.0 and tags["moe/block4/mean_k"] == 1.0
    assert "moe/block4/rank_load_max_over_mean" in tags
    assert not any("layer" in tag or tag.endswith("/blocks") for tag in tags), sorted(tags)
    assert "event/block5/moves" in scalar_tags(EVENT)
    old = {k: v for k, v in STEP.items() if k != "blocks"}
    assert "moe/layer1/num_experts" in scalar_tags(old)


def test_report_labels_layers_by_block():
    from matplotlib.figure import Figure

    series = report_series([STEP, EVENT])
    assert series.blocks == [4, 5] and series.layer_label(1) == "block 5"
    ax = Figure().add_subplot()
    report._draw_per_layer(ax, series, "num_experts_S", "Experts", "experts", steps_drawstyle=True)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["block 4", "block 5"]
    assert report_series([{k: v for k, v in STEP.items() if k != "blocks"}]).layer_label(1) == "MoE layer 1"
