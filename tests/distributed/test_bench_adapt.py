"""`bench adapt` end to end at a shortened demo run (2 gloo ranks, skewed routing, one event): the
event really removes, adds, moves and replicates experts and is timed phase by phase. No timing is
asserted."""

from dynmoe_dist.bench import adapt


def test_skewed_demo_event_does_every_kind_of_change():
    result = adapt.scenario(2, True, str(adapt.DEMO), ["train.max_steps=28"], repeats=1, timeout=240)
    assert result["steps_per_run"] == 28
    (event,) = result["events"]  # the window of the demo's first epoch ends after step 25
    assert event["after_step"] == 25
    layers = {change["layer"]: change for change in event["changed_layers"]}
    # layer 0: expert 0 takes every token -> replicated on both ranks, experts moved to balance
    assert layers[0]["replicas"] == {"0": 2} and layers[0]["moved"] > 0
    assert layers[0]["planned_imbalance_after"] < layers[0]["planned_imbalance_before"]
    # layer 1: most tokens pick no expert -> one added; an expert nobody picked -> removed
    assert layers[1]["added"] == 1 and layers[1]["removed"] == 1
    seconds = event["seconds"]
    assert seconds["event_s"]["min"] > 0 and seconds["apply_s"]["min"] >= 0
    assert seconds["event_s"]["min"] >= seconds["plan_s"]["min"]
