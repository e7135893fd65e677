"""``InboxSettings`` checks a consumer group's tuning when it is made and names the bad field.

``Inbox(…)``'s keywords build one (``Inbox.settings``): a bad value is refused
before the inbox opens a connection, which is what is proved here (no database
is reached: the engine is never connected).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from outbox import ConfigurationError, Inbox
from outbox.inbox import ForeignRecords, StartPolicy
from outbox.inbox._settings import InboxSettings, in_flight_limits

not_numbers = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf), st.booleans(),
                        st.text(max_size=3), st.just([1.0]))
not_positive = st.one_of(not_numbers, st.floats(max_value=0.0, allow_nan=False), st.integers(max_value=0),
                         st.just(timedelta(0)), st.just(timedelta(seconds=-1)))

SECONDS = {"gap_timeout": not_positive, "dedup_window": not_positive, "batch_budget": not_positive,
           "retry_backoff": st.one_of(not_numbers, st.floats(max_value=-1e-9, allow_nan=False)),
           "retry_backoff_max": st.one_of(not_numbers, st.integers(max_value=-1))}
INTS = {"max_attempts": 100, "concurrency": 1024, "batch_size": 10_000}


@given(data=st.data(), field=st.sampled_from(sorted(SECONDS)))
def test_seconds_that_are_out_of_range_are_refused_by_name(data: st.DataObject, field: str) -> None:
    value = data.draw(SECONDS[field])
    with pytest.raises(ConfigurationError, match=f"^{field} must be "):
        InboxSettings.of(group="g", **{field: value})


@pytest.mark.parametrize("field", [*sorted(SECONDS), "gap_alert_after"])
def test_seconds_past_any_float_are_refused_by_name(field: str) -> None:
    """Found by an attack on ``batch_budget``: an int too large for a float (``10**400``) raised
    ``OverflowError`` out of ``math.isfinite``, not the error that names the setting."""
    with pytest.raises(ConfigurationError, match=f"^{field} must be "):
        InboxSettings.of(group="g", **{field: 10**400})


@given(field=st.sampled_from(sorted(INTS)),
       value=st.one_of(st.integers(max_value=0), st.integers(min_value=10_001), st.booleans(),
                       st.floats(), st.text(max_size=2)))
def test_counts_out_of_range_are_refused_by_name(field: str, value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INTS[field]:
        return
    with pytest.raises(ConfigurationError, match=f"^{field} must be an int from 1 to {INTS[field]}"):
        InboxSettings.of(group="g", **{field: value})


@pytest.mark.parametrize("group", ["", "   ", "x" * 256, None, 7])
def test_a_group_must_be_named(group: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^group must be a non-empty str"):
        InboxSettings.of(group=group)


def test_gap_alert_after_must_come_before_the_gap_timeout() -> None:
    with pytest.raises(ConfigurationError, match=r"^gap_alert_after must be positive seconds below "
                                                 r"gap_timeout \(10\)"):
        InboxSettings.of(group="g", gap_timeout=10, gap_alert_after=10)
    assert InboxSettings.of(group="g", gap_timeout=10).gap_alert_after == 5.0


def test_policies_are_named_values_and_timedeltas_are_seconds() -> None:
    settings = InboxSettings.of(group="g", foreign_records="accept", start="first_seen",
                                gap_timeout=timedelta(minutes=2), dedup_window=timedelta(days=1))
    assert settings.foreign_records is ForeignRecords.ACCEPT and settings.start is StartPolicy.FIRST_SEEN
    assert (settings.gap_timeout, settings.dedup_window) == (120.0, 86_400.0)
    with pytest.raises(ConfigurationError, match=r"^start must be one of"):
        InboxSettings.of(group="g", start="whenever")


def test_the_inbox_refuses_before_it_connects_and_keeps_its_settings() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never reached
    with pytest.raises(ConfigurationError, match=r"^gap_timeout must be positive seconds"):
        Inbox(engine, group="g", gap_timeout=math.nan)
    inbox = Inbox(sa.create_engine("sqlite://"), group="g", batch_size=50, dedup_window=timedelta(hours=1))
    assert (inbox.settings.batch_size, inbox.settings.dedup_window) == (50, 3600.0)


def test_the_defaults_a_newcomer_reads_are_the_defaults_the_inbox_has() -> None:
    """``concurrency`` and ``batch_size`` as ``Inbox(engine, group=...)`` gives them are what
    getting-started, consumer.md's settings table and ``outbox inbox run --help`` say."""
    import inspect
    from pathlib import Path

    from typer.testing import CliRunner

    from outbox.cli import app

    parameters = inspect.signature(Inbox).parameters
    concurrency, batch_size = parameters["concurrency"].default, parameters["batch_size"].default
    inbox = Inbox(sa.create_engine("sqlite://"), group="g")
    assert (inbox.concurrency, inbox.batch_size) == (concurrency, batch_size)
    docs = Path(__file__).resolve().parent.parent / "docs"
    started = " ".join((docs / "getting-started.md").read_text().split())
    assert f"on {concurrency} keys at once (`concurrency`) and applies up to {batch_size} messages" in started
    consumer = (docs / "consumer.md").read_text()
    assert f"| `batch_size` | {batch_size} |" in consumer and f"| `concurrency` | {concurrency} |" in consumer
    shown = CliRunner().invoke(app, ["inbox", "run", "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert f"{concurrency} and {batch_size} unless it sets them" in " ".join(shown.output.split())


def test_the_default_batch_size_holds_no_more_deliveries_in_memory_than_before() -> None:
    """500 a transaction runs 16,000 deliveries at most but holds no more than 100 a transaction did."""
    assert in_flight_limits(8, 500) == (16_000, 64_000)
    assert in_flight_limits(8, 100) == (3_200, 64_000)
    assert in_flight_limits(1, 1) == (1_000, 20_000)
    assert in_flight_limits(64, 1_000) == (256_000, 256_000)  # never fewer held than may run
