"""Expert identity across adaptive events, and what triggered each add. Pure (no torch).

Event records (metrics.jsonl, kind 'event') name experts by position: after an event the kept experts
are renumbered 0..n-1 in their old order and the added ones follow (planning/planner.py). Replaying
the events from the initial expert count gives every expert a stable identity, so one can ask whether an
expert added at one event is removed at a later one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence


def track_experts(events: Sequence[Dict], initial_counts: Sequence[int]) -> List[Dict]:
    """Per layer: {'added': [{'id', 'step', 'removed_step'}], 'initial_removed', 'final': ids at the end}.
    Identities: 'init<i>' for the starting experts, 'add<step>.<j>' for the j-th expert added at step."""
    layers: List[Dict[str, Any]] = [
        {"ids": [f"init{i}" for i in range(n)], "added": {}, "initial_removed": 0} for n in initial_counts
    ]
    for event in sorted(events, key=lambda e: (e["step"], e["layer"])):
        layer = layers[event["layer"]]
        removed = set(event["removed"])
        if removed and max(removed) >= len(layer["ids"]):
            raise ValueError(
                f"event at step {event['step']}, layer {event['layer']} removes expert "
                f"{max(removed)} of {len(layer['ids'])}: the events do not replay"
            )
        for position in sorted(removed):
            gone = layer["ids"][position]
            if gone in layer["added"]:
                layer["added"][gone]["removed_step"] = event["step"]
            else:
                layer["initial_removed"] += 1
        ids = [e for i, e in enumerate(layer["ids"]) if i not in removed]
        for j, _ in enumerate(event["added"]):
            new = f"add{event['step']}.{j}"
            layer["added"][new] = {"id": new, "step": event["step"], "removed_step": None}
            ids.append(new)
        if len(ids) != event["num_experts"]:
            raise ValueError(
                f"event at step {event['step']}, layer {event['layer']}: replay gives {len(ids)} "
                f"experts, the record says {event['num_experts']}"
            )
        layer["ids"] = ids
    return [
        {"added": list(layer["added"].values()), "initial_removed": layer["initial_removed"], "final": layer["ids"]}
        for layer in layers
    ]


def growth_summary(windows: Sequence[Dict], tracked: Sequence[Dict]) -> List[Dict]:
    """Per layer: how many windows closed, at how many an expert was added, the unrouted tokens behind
    those adds (counts and shares), and how many added experts were later removed."""
    out = []
    for index, layer in enumerate(tracked):
        mine = [w for w in windows if w["layer"] == index]
        adds = [w for w in mine if w["added"]]
        out.append(
            {
                "layer": index,
                "num_windows": len(mine),
                "windows_with_add": len(adds),
                "windows_with_unrouted": sum(1 for w in mine if w["num_unrouted"] > 0),
                "trigger_unrouted": [w["num_unrouted"] for w in adds],
                "trigger_share": [w["unrouted_share"] for w in adds],
                "num_added": len(layer["added"]),
                "added_later_removed": sum(1 for a in layer["added"] if a["removed_step"] is not None),
                "initial_removed": layer["initial_removed"],
                "final_experts": len(layer["final"]),
            }
        )
    return out
