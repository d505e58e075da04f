"""WindowSchedule (train/adaptive.py): which optimizer steps record routing statistics, and after which
step the adaptation event runs. Pure arithmetic, worked by hand below.

Rule: period = adaptive.period_steps or steps_per_epoch; start = int(period * window_start);
end = max(start + 1, int(period * window_end)); start clamped to period - 1, end to period.
Steps are 0-based optimizer-step indices; the window is [start, end) of every period and the event runs
after step end - 1.
"""

import pytest

from dynmoe_dist.config import AdaptiveConfig
from dynmoe_dist.train.adaptive import WindowSchedule
from dynmoe_dist.train.data import BatchSchedule


def _window(steps_per_epoch, **adaptive):
    return WindowSchedule.build(AdaptiveConfig(**adaptive), steps_per_epoch)


def _recorded(schedule, num_steps):
    return [s for s in range(num_steps) if schedule.recording(s)]


def _starts(schedule, num_steps):
    return [s for s in range(num_steps) if schedule.starts_at(s)]


def _ends(schedule, num_steps):
    return [s for s in range(num_steps) if schedule.ends_at(s)]


@pytest.mark.parametrize(
    "steps_per_epoch, start, end, recorded, ends",
    [
        # 9: 9/3 = 3, 18/3 = 6 -> steps 3, 4, 5 of each epoch; event after 5 (and 14 in epoch 1)
        (9, 3, 6, [3, 4, 5, 12, 13, 14], [5, 14]),
        # 10: int(3.33) = 3, int(6.67) = 6 -> steps 3, 4, 5; event after 5, 15
        (10, 3, 6, [3, 4, 5, 13, 14, 15], [5, 15]),
        # 3: int(1) = 1, int(2) = 2 -> only step 1 of each epoch; event after 1, 4
        (3, 1, 2, [1, 4], [1, 4]),
        # 1: int(.33) = 0, max(0 + 1, int(.67) = 0) = 1 -> every step records, every step ends a window
        (1, 0, 1, [0, 1], [0, 1]),
    ],
)
def test_default_one_third_to_two_thirds_window(steps_per_epoch, start, end, recorded, ends):
    schedule = _window(steps_per_epoch)
    assert (schedule.period, schedule.start, schedule.end) == (steps_per_epoch, start, end)
    num_steps = 2 * steps_per_epoch
    assert _recorded(schedule, num_steps) == recorded
    assert _ends(schedule, num_steps) == ends
    assert _starts(schedule, num_steps) == [start, steps_per_epoch + start]


def test_window_end_is_exclusive_and_the_event_follows_its_last_step():
    schedule = _window(9)  # start 3, end 6
    assert schedule.ends_at(5) and not schedule.ends_at(6) and not schedule.ends_at(4)
    assert schedule.recording(5) and not schedule.recording(6)
    assert schedule.recording(3) and not schedule.recording(2)
    assert schedule.starts_at(3) and not schedule.starts_at(2) and not schedule.starts_at(4)
    # The same one period later (9 + 5 = 14 ends, 15 does not record).
    assert schedule.ends_at(14) and not schedule.ends_at(15) and not schedule.recording(15)


@pytest.mark.parametrize(
    "period_steps, start, end, recorded, ends",
    [
        # 6: 2, 4 -> steps 2, 3 of every 6; events after 3, 9, 15
        (6, 2, 4, [2, 3, 8, 9, 14, 15], [3, 9, 15]),
        # 4: int(1.33) = 1, max(2, int(2.67) = 2) = 2 -> step 1 of every 4
        (4, 1, 2, [1, 5, 9, 13, 17], [1, 5, 9, 13, 17]),
    ],
)
def test_period_steps_replaces_the_epoch(period_steps, start, end, recorded, ends):
    schedule = _window(100, period_steps=period_steps)  # the epoch length (100) is then ignored
    assert (schedule.period, schedule.start, schedule.end) == (period_steps, start, end)
    assert _recorded(schedule, 18) == recorded
    assert _ends(schedule, 18) == ends


@pytest.mark.parametrize(
    "steps_per_epoch, window_start, window_end, start, end",
    [
        (10, 0.0, 1.0, 0, 10),  # whole epoch: steps 0..9, event after 9
        (5, 0.9, 1.0, 4, 5),  # int(4.5) = 4, int(5.0) = 5 -> only the last step
        (3, 0.5, 0.6, 1, 2),  # int(1.5) = 1, int(1.8) = 1 -> widened to one step: end = start + 1 = 2
        (4, 0.0, 0.1, 0, 1),  # int(0.4) = 0 -> widened to [0, 1)
        (1, 0.99, 1.0, 0, 1),  # int(.99) = 0, end 1: the only step
    ],
)
def test_window_fractions_at_their_bounds(steps_per_epoch, window_start, window_end, start, end):
    schedule = _window(steps_per_epoch, window_start=window_start, window_end=window_end)
    assert (schedule.start, schedule.end) == (start, end)
    assert _recorded(schedule, steps_per_epoch) == list(range(start, end))
    assert _ends(schedule, steps_per_epoch) == [end - 1]


def test_window_is_counted_in_optimizer_steps_not_micro_batches():
    # The trainer builds the window from BatchSchedule.steps_per_epoch (train/loop.py, adaptive.py).
    # 90 samples, global batch 10: 9 optimizer steps per epoch whether each step runs 1 or 2 micro-
    # batches (micro-batch 10 or 5). Counted in forward calls, grad_accum 2 would see 18 "steps" and
    # record steps 6..11 of 18 instead.
    recorded = {}
    for grad_accum in (1, 2):
        batches = BatchSchedule(
            num_train=90, global_batch_size=10, grad_accum=grad_accum, epochs=2.0, max_steps=0, seed=0
        )
        assert batches.micro_batch_size == 10 // grad_accum
        schedule = WindowSchedule.build(AdaptiveConfig(), batches.steps_per_epoch)
        recorded[grad_accum] = (_recorded(schedule, batches.total_steps), _ends(schedule, batches.total_steps))
    assert recorded[1] == recorded[2] == ([3, 4, 5, 12, 13, 14], [5, 14])
