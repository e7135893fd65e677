"""The one outage module relay and inbox share (``outbox.core._outage``): pacing and telling.

No server: what is proved here is arithmetic and bookkeeping. That a real
outage is waited out is proved by the relay and inbox outage campaigns.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import tenacity
from hypothesis import given
from hypothesis import strategies as st

from outbox import ConfigurationError
from outbox.core._outage import (
    RELAY_WORDING,
    OutageBackoff,
    OutageGate,
    OutageTracker,
    delay_before,
)
from outbox.inbox._outage import OutageLog

waits = st.one_of(
    st.builds(tenacity.wait_exponential, multiplier=st.floats(0.001, 10), max=st.floats(0.01, 100)),
    st.builds(tenacity.wait_fixed, st.floats(0, 100)),
    st.builds(tenacity.wait_incrementing, start=st.floats(0, 10), increment=st.floats(0, 10),
              max=st.floats(0, 100)),
)


@given(wait=waits, attempts=st.integers(1, 12))
def test_delay_before_is_what_tenacity_itself_sleeps(wait: tenacity.wait.wait_base, attempts: int) -> None:
    """The one place that evaluates a wait strategy gives the sleeps tenacity's own loop takes."""
    slept: list[float] = []

    def fail() -> None:
        raise OSError("down")

    retrying = tenacity.Retrying(wait=wait, stop=tenacity.stop_after_attempt(attempts + 1),
                                 sleep=slept.append, reraise=True)
    with pytest.raises(OSError):
        retrying(fail)
    assert slept == [delay_before(wait, n) for n in range(1, attempts + 1)]


@given(first=st.floats(0.001, 10), cap=st.floats(0.001, 100), failures=st.integers(1, 10_000))
def test_outage_backoff_doubles_from_first_up_to_cap(first: float, cap: float, failures: int) -> None:
    delay = OutageBackoff(first=first, cap=cap).delay(failures)
    assert delay == pytest.approx(min(cap, first * 2.0 ** min(failures - 1, 60)))


@given(jitter=st.floats(0, 1), failures=st.integers(1, 50))
def test_jitter_only_shortens_a_delay_by_at_most_its_fraction(jitter: float, failures: int) -> None:
    plain = OutageBackoff().delay(failures)
    jittered = OutageBackoff(jitter=jitter).delay(failures)
    assert plain * (1 - jitter) - 1e-12 <= jittered <= plain + 1e-12


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"first": 0}, "first"), ({"first": True}, "first"), ({"cap": -1.0}, "cap"),
    ({"cap": float("nan")}, "cap"), ({"jitter": 1.5}, "jitter"), ({"jitter": "0.1"}, "jitter"),
])
def test_a_bad_backoff_setting_is_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=f"OutageBackoff.{field} "):
        OutageBackoff(**kwargs)


def test_an_outage_is_logged_and_counted_once_however_many_threads_report_it(
        caplog: pytest.LogCaptureFixture) -> None:
    counted: list[None] = []
    tracker = OutageTracker("relay a: database", log=logging.getLogger("test.outage"),
                            wording=RELAY_WORDING, count=lambda: counted.append(None))
    go = threading.Barrier(8)

    def report() -> None:
        go.wait()
        for _ in range(200):
            tracker.failed(OSError("connection refused\nsecond line"))

    with caplog.at_level(logging.WARNING, "test.outage"):
        threads = [threading.Thread(target=report) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tracker.down
        for _ in range(3):
            tracker.answered()
        tracker.failed("no delivery report")
        tracker.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("relay a: database unreachable (OSError: connection refused); "
                        "waiting with capped backoff")
    assert lines[1].startswith("relay a: database reachable again after ")
    assert lines[2] == "relay a: database unreachable (no delivery report); waiting with capped backoff"
    assert lines[3].startswith("relay a: database reachable again after ")
    assert len(lines) == 4 and len(counted) == 2 and not tracker.down


def test_the_backoff_restarts_from_first_after_an_answer() -> None:
    tracker = OutageTracker("db", log=logging.getLogger("test.outage"), backoff=OutageBackoff(first=0.5))
    assert [tracker.failed("down") for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 5.0]
    tracker.answered()
    assert tracker.failed("down") == 0.5


def test_the_inbox_waits_from_a_jittered_fifth_of_a_second_up_to_five(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = OutageLog()
    with caplog.at_level(logging.WARNING, "outbox.inbox"):
        delays = [outage.failed(OSError("refused")) for _ in range(12)]
    assert 0.15 <= delays[0] <= 0.2 and all(3.75 <= d <= 5.0 for d in delays[6:])
    assert [r.getMessage() for r in caplog.records] == [
        "the database unavailable (OSError: refused); waiting for it, nothing counts as a failed "
        "attempt meanwhile"]


# -- the gate: a dependency that is down, probed by one caller at a time -----------------------


def test_a_closed_gate_lets_one_probe_through_at_a_time_and_puts_the_others_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("outbox.core._outage.time.monotonic", lambda: clock[0])
    tracker = OutageTracker("db", log=logging.getLogger("test.outage"), backoff=OutageBackoff(first=2.0))
    gate = OutageGate(tracker, least=0.2)
    assert gate.admit() is None and not gate.down  # open: everyone goes
    assert gate.failed(OSError("refused")) == 2.0
    assert gate.down and tracker.down
    assert gate.admit() == 2.0  # not before the backoff
    clock[0] += 1.9
    assert gate.admit() == pytest.approx(0.2)  # never less than least
    clock[0] += 0.2
    assert gate.admit() is None  # the probe
    assert gate.admit() == 0.2  # the others wait while it probes
    assert gate.failed(OSError("refused")) == 4.0  # its second failure: the backoff doubles
    clock[0] += 4.0
    assert gate.admit() is None
    assert gate.answered() is True  # it opened the gate: who waited may go now
    assert not gate.down and not tracker.down and gate.admit() is None
    assert gate.answered() is False


def test_a_probe_that_ends_without_a_verdict_hands_the_probe_on(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = OutageGate(closed=True)  # e.g. tables not checked yet: the first caller probes
    assert gate.admit() is None
    seen: list[float | None] = []
    other = threading.Thread(target=lambda: (seen.append(gate.admit()), gate.probed()))
    other.start()
    other.join()
    assert seen[0] is not None, "a second probe went through"
    assert gate.admit() is not None  # another thread's probed() does not end this one's probe
    gate.probed()
    assert gate.admit() is None  # this thread's did


def test_a_close_never_brings_the_next_probe_forward() -> None:
    gate = OutageGate()
    assert gate.close(5.0) == pytest.approx(5.0, abs=0.1)
    assert gate.close(0.1) == pytest.approx(5.0, abs=0.1)  # a late, shorter failure: still 5 s
    with pytest.raises(ConfigurationError, match="tracker"):
        gate.failed("down")


def test_work_that_began_before_the_outage_was_told_does_not_end_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long transaction that committed just before the server went away answered nothing about now:
    the outage another thread met meanwhile is not logged as over (and then again as begun)."""
    clock = [10.0]
    monkeypatch.setattr("outbox.core._outage.time.monotonic", lambda: clock[0])
    tracker = OutageTracker("db", log=logging.getLogger("test.outage"))
    gate = OutageGate(tracker)
    began = clock[0]  # a round of work starts
    clock[0] += 1.0
    gate.failed(OSError("terminating connection"))  # another thread meets the outage
    clock[0] += 0.1
    assert gate.answered(began) is False  # the round, begun before, ends well
    assert gate.down and tracker.down
    clock[0] += 1.0
    assert gate.answered(clock[0] - 0.5) is True  # work begun after the outage was told
    assert not gate.down and not tracker.down


def test_a_probe_answering_after_the_gate_closed_again_ends_neither_gate_nor_tracker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Work begun after the outage was first told, but before the gate closed again (a later
    failure: the dependency still down), answers nothing about now: the tracker stays down too.
    It used to log "available again" while the gate stayed closed, and "unavailable" at the next
    failure."""
    clock = [10.0]
    monkeypatch.setattr("outbox.core._outage.time.monotonic", lambda: clock[0])
    tracker = OutageTracker("db", log=logging.getLogger("test.outage"))
    gate = OutageGate(tracker)
    gate.failed(OSError("refused"))  # told at 10
    clock[0] += 1.0
    began = clock[0]  # a probe starts at 11
    clock[0] += 1.0
    gate.failed(OSError("refused"))  # another caller fails at 12: closed again
    clock[0] += 0.1
    assert gate.answered(began) is False
    assert gate.down and tracker.down
