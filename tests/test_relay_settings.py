"""``RelaySettings`` checks a relay's tuning when it is made and names the bad field.

No broker: the settings are refused before the relay touches the database or
the transport, which is what is proved here (``Relay``'s keywords build one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import tenacity
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.cli import app
from outbox.relay import RelaySettings
from outbox.testing import InMemoryTransport

REFUSED = r" must be positive seconds up to 31536000 \(a year\), got "
SECONDS = ("lease_ttl", "poll_interval", "wheel_tick", "key_stuck_after")

not_positive_seconds = st.one_of(
    st.floats(max_value=0.0), st.just(math.nan), st.booleans(), st.integers(max_value=0),
    st.text(max_size=3), st.none(), st.just([1.0]),
    # Past a year: inf (a lease no dead relay loses), and what timedelta or Event.wait refuse.
    st.floats(min_value=365 * 24 * 3600.0, exclude_min=True), st.just(10**400),
    st.integers(min_value=365 * 24 * 3600 + 1),
)


@given(field=st.sampled_from(SECONDS), value=not_positive_seconds)
def test_seconds_that_are_not_positive_numbers_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=f"^{field}{REFUSED}"):
        RelaySettings(**{field: value})


@given(field=st.sampled_from(SECONDS), value=st.one_of(st.integers(1, 10**6), st.floats(1e-6, 1e6)))
def test_positive_seconds_are_kept_as_floats(field: str, value: float) -> None:
    assert getattr(RelaySettings(**{field: value}), field) == float(value)
    assert type(getattr(RelaySettings(**{field: value}), field)) is float


@given(size=st.one_of(st.integers(max_value=0), st.integers(min_value=100_001), st.booleans(),
                      st.floats(), st.text(max_size=3)))
def test_a_batch_size_outside_one_to_100000_is_refused(size: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^batch_size must be an int from 1 to 100000"):
        RelaySettings(batch_size=size)


def test_worker_id_and_backoff_are_checked_and_the_defaults_hold() -> None:
    with pytest.raises(ConfigurationError, match=r"^worker_id must be a str of at most 200"):
        RelaySettings(worker_id="w" * 201)
    with pytest.raises(ConfigurationError, match=r"^backoff must be a tenacity wait strategy"):
        RelaySettings(backoff=3)
    assert RelaySettings(worker_id="").worker_id != ""  # empty: the default, as Relay did
    a, b = RelaySettings(), RelaySettings()
    assert a.worker_id != b.worker_id and a.poll_interval == 0.5
    assert a.batch_size == 5000
    assert isinstance(a.backoff, tenacity.wait.wait_base)


def test_relay_keywords_build_the_settings_and_a_nan_is_refused(tmp_path: Any) -> None:
    """A NaN interval passed ``value <= 0`` before; waits of NaN seconds are nonsense."""
    outbox = Outbox(sa.create_engine(f"sqlite:///{tmp_path / 'o.db'}"))
    outbox.create_tables()
    relay = Relay(outbox, InMemoryTransport(), worker_id="w1", batch_size=7, poll_interval=2)
    assert relay.settings == RelaySettings(worker_id="w1", batch_size=7, poll_interval=2.0,
                                           backoff=relay.settings.backoff)
    relay.close()
    for field in SECONDS:
        with pytest.raises(ConfigurationError, match=f"^{field}{REFUSED}nan"):
            Relay(outbox, InMemoryTransport(), **{field: math.nan})


class _Built(Exception):
    """Raised by a stand-in for the relay the CLI builds, once it has seen its keywords."""


def _batch_sizes_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch sizes `outbox relay` builds its relays (or its fleet) with, in order; each build
    raises ``_Built`` instead of running."""
    import outbox.relay as relay

    seen: list[int] = []

    def built(*args: Any, **kwargs: Any) -> None:
        seen.append(kwargs["batch_size"])
        raise _Built
    monkeypatch.setattr(relay, "Relay", built)
    monkeypatch.setattr("outbox.cli._relay._relay_tenants", built)
    return seen


def test_outbox_relay_batches_5000_rows_and_1000_per_tenant_unless_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One relay serves no one else: a larger batch pays a batch's fixed cost over more rows
    (docs/relay.md, "The batch size"). A fleet's workers take tenants a batch at a time: 1000."""
    seen = _batch_sizes_built(monkeypatch)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    Outbox(create_engine(url)).create_tables()
    base = ["relay", "--db", url, "--bootstrap-servers", "127.0.0.1:1"]
    tenants = ["--tenants", "a,b"]
    for extra in ([], ["--batch-size", "700"], tenants, [*tenants, "--batch-size", "700"]):
        result = CliRunner().invoke(app, [*base, *extra])
        assert "_Built" in result.output, result.output
    assert seen == [5000, 700, 1000, 700]


def test_outbox_relay_exactly_once_fits_its_default_batch_to_a_lowered_record_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly-once's progress record names three batches of row ids, two of them with a tag of each
    row's message, and where each record went, and must fit the producer's ``message.max.bytes``:
    with a lowered limit the default batch is the largest that fits rather than a refusal of a
    --batch-size nobody gave; one given is still checked as given."""
    seen = _batch_sizes_built(monkeypatch)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    made = CliRunner().invoke(app, ["init-db", "--db", url, "--max-record-bytes", "30000"])
    assert made.exit_code == 0, made.output
    base = ["relay", "--db", url, "--bootstrap-servers", "127.0.0.1:1", "--exactly-once"]
    small = ["--kafka-config", "message.max.bytes=100000"]
    tiny = ["--kafka-config", "message.max.bytes=40000"]
    for extra in ([], small, [*small, "--batch-size", "4000"], ["--tenants", "a,b", *tiny]):
        result = CliRunner().invoke(app, [*base, *extra])
        assert "_Built" in result.output, result.output
    # (limit - 1,024 overhead - 2,075 topics header - 31 positions header - 200 for the longest relay
    # name) // (3 x 21 for ids + 2 x 8 for their messages' tags + 35 for a record's position)
    assert seen == [5000, 847, 4000, 321]
