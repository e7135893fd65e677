"""The hashed timing wheel: deadline order, never early, cancel, rounds for long delays."""

from __future__ import annotations

import random

import pytest

from outbox import ConfigurationError
from outbox.core._wheel import TimingWheel


def test_many_timers_in_one_tick_fire_in_deadline_order() -> None:
    wheel: TimingWheel[int] = TimingWheel(tick=1.0, slots=8)
    deadlines = [5 + random.random() * 0.99 for _ in range(1000)]
    for item, deadline in enumerate(deadlines):
        wheel.schedule(item, deadline)
    assert wheel.advance(5.0) == []
    fired = wheel.advance(6.0)
    assert fired == sorted(range(1000), key=lambda i: deadlines[i])
    assert len(wheel) == 0


def test_nothing_fires_before_its_deadline_and_all_fire_after() -> None:
    wheel: TimingWheel[int] = TimingWheel(tick=0.05, slots=16)
    rng = random.Random(7)
    deadlines = {i: rng.uniform(0, 10) for i in range(2000)}
    for item, deadline in deadlines.items():
        wheel.schedule(item, deadline)
    now, fired_at = 0.0, {}
    while wheel:
        now += rng.uniform(0.001, 0.3)
        for item in wheel.advance(now):
            fired_at[item] = now
    assert set(fired_at) == set(deadlines)
    for item, at in fired_at.items():
        assert deadlines[item] <= at < deadlines[item] + 0.05 + 0.3


def test_cancel_removes_the_timer() -> None:
    wheel: TimingWheel[str] = TimingWheel(tick=0.1, slots=4)
    wheel.schedule("a", 1.0)
    wheel.schedule("b", 1.0)
    assert wheel.cancel("a") is True
    assert wheel.cancel("a") is False
    assert "a" not in wheel and "b" in wheel
    assert wheel.advance(2.0) == ["b"]


def test_rescheduling_replaces_the_timer() -> None:
    wheel: TimingWheel[str] = TimingWheel(tick=0.1, slots=4)
    wheel.schedule("a", 1.0)
    wheel.schedule("a", 3.0)
    assert len(wheel) == 1 and wheel.deadline("a") == 3.0
    assert wheel.advance(2.0) == []
    assert wheel.advance(3.1) == ["a"]


def test_long_delays_wrap_rounds() -> None:
    # 8 slots of 1 s: a 100 s delay goes round the wheel 12 times before firing.
    wheel: TimingWheel[str] = TimingWheel(tick=1.0, slots=8)
    wheel.schedule("far", 100.0)
    wheel.schedule("near", 4.0)
    fired = []
    for second in range(1, 101):
        fired += [(second, item) for item in wheel.advance(float(second))]
    assert fired == [(4, "near"), (100, "far")]


def test_a_long_pause_fires_everything_due_at_once() -> None:
    wheel: TimingWheel[int] = TimingWheel(tick=1.0, slots=8)
    for i in range(50):
        wheel.schedule(i, float(i * 3))
    assert wheel.advance(75.5) == list(range(26))
    assert len(wheel) == 24


def test_past_deadline_fires_with_the_next_tick() -> None:
    wheel: TimingWheel[str] = TimingWheel(tick=1.0, slots=8, start=10.0)
    wheel.advance(20.0)
    wheel.schedule("late", 3.0)
    assert wheel.advance(20.5) == []
    assert wheel.advance(21.0) == ["late"]


@pytest.mark.parametrize("seed", range(20))
def test_next_due_is_when_advance_fires_the_earliest_timer(seed: int) -> None:
    """What a scheduler sleeps until: nothing fires just before it, the earliest fires at it."""
    rng = random.Random(seed)
    tick = rng.choice([0.02, 0.05, 1.0])
    now = rng.uniform(0, 1e6)
    wheel: TimingWheel[int] = TimingWheel(tick=tick, slots=rng.choice([8, 512]), start=now)
    assert wheel.next_due() is None
    deadlines = {i: now + rng.uniform(-5, 50) * tick for i in range(rng.randint(1, 30))}
    for item, deadline in deadlines.items():
        wheel.schedule(item, deadline)
    while len(wheel):
        due = wheel.next_due()
        assert due is not None
        assert wheel.advance(due - tick * 1e-3) == []
        fired = wheel.advance(due)
        assert fired, "nothing fired at next_due"
        assert fired[0] == min((d, i) for i, d in deadlines.items() if i in fired)[1]
        assert all(due >= deadlines[item] for item in fired)  # never early
    assert wheel.next_due() is None


@pytest.mark.parametrize("kwargs", [{"tick": 0}, {"tick": -1}, {"slots": 0}, {"slots": 2.5}])
def test_bad_settings_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ConfigurationError):
        TimingWheel(**kwargs)
