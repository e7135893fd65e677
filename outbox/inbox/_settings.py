"""``InboxSettings``: a consumer group's tuning, checked when it is made, each bad value named by its field.

``Inbox(…)``'s keywords of the same names build one (``Inbox.settings``), so
the constructor wires stages instead of validating; the relay's twin is
``outbox.relay.RelaySettings``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from ..core._errors import ConfigurationError
from ..core._foreign import ForeignEnvelope
from ._kinds import ForeignRecords, StartPolicy, UnknownEvents

MAX_ATTEMPTS = 100
MAX_CONCURRENCY = 1024
MAX_BATCH_SIZE = 10_000
DEFAULT_BATCH_SIZE = 500
"""Messages per transaction unless told: a per-message handler's run of one key, or many keys'
heads, share one lock, claim, advance and commit (docs/consumer.md, "Choosing the settings")."""
DEFAULT_BATCH_BUDGET = 1.0
"""Seconds after which a transaction starts no more handlers unless told: what bounds a batch of
a slow handler, whatever ``batch_size`` allows (docs/consumer.md, "Choosing the settings")."""


@dataclass(frozen=True)
class InboxSettings:
    """How one ``Inbox`` works. Seconds are kept as floats; a ``timedelta`` is accepted for each."""

    group: str
    """The consumer group: whose positions, dedup records and parked messages these are (≤ 255 chars)."""
    max_attempts: int = 3
    """Handler attempts before a message parks with its key (1 to 100)."""
    concurrency: int = 8
    """Keys worked on at once (1 to 1024)."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Messages per transaction at most (1 to 10,000); a batch takes what is ready, it never waits to fill."""
    batch_budget: float = DEFAULT_BATCH_BUDGET
    """Seconds a transaction starts handlers for: past it, the transaction commits what ran and the
    rest of its batch follows in the next one (its first handler always runs)."""
    gap_timeout: float = 60.0
    """Seconds a held message waits for its predecessor before its key parks (reason ``gap``)."""
    gap_alert_after: float | None = None
    """Seconds a gap is held before one ``gap_held`` alert; None: half of ``gap_timeout``."""
    retry_backoff: float = 0.1
    """The first retry's delay and the jitter, in seconds (exponential, tenacity's)."""
    retry_backoff_max: float = 5.0
    """The longest retry delay, in seconds."""
    foreign_records: ForeignRecords | ForeignEnvelope = ForeignRecords.PARK
    """What a record without the outbox envelope becomes: parked, handed over unkeyed, or read by
    the event id header a ``ForeignEnvelope`` names (``"debezium"``: ``ForeignEnvelope.debezium()``)."""
    start: StartPolicy = StartPolicy.STRICT
    """Where a key first met past seq 1 starts (``_conflicts``)."""
    dedup_window: float | None = None
    """Seconds after which this group's dedup records may be pruned; None: never."""
    unknown_event: UnknownEvents = UnknownEvents.PARK
    """What a typed topic's message of no handled type, or not valid for its model, becomes."""

    @classmethod
    def of(cls, *, group: str, max_attempts: int = 3, concurrency: int = 8,
           batch_size: int = DEFAULT_BATCH_SIZE,
           batch_budget: timedelta | float = DEFAULT_BATCH_BUDGET, gap_timeout: timedelta | float = 60.0,
           gap_alert_after: timedelta | float | None = None,
           retry_backoff: float = 0.1, retry_backoff_max: float = 5.0,
           foreign_records: ForeignRecords | ForeignEnvelope | str = ForeignRecords.PARK,
           start: StartPolicy | str = StartPolicy.STRICT,
           dedup_window: timedelta | float | None = None,
           unknown_event: UnknownEvents | str = UnknownEvents.PARK) -> InboxSettings:
        """Settings from what a user passes (``timedelta`` or seconds, enum or its value)."""
        foreign = _foreign_policy(foreign_records)
        try:
            unknown = UnknownEvents(unknown_event)
        except ValueError:
            raise ConfigurationError(f"unknown_event must be one of {[p.value for p in UnknownEvents]}, "
                                     f"got {unknown_event!r}") from None
        try:
            policy = StartPolicy(start)
        except ValueError:
            raise ConfigurationError(f"start must be one of {[p.value for p in StartPolicy]}, "
                                     f"got {start!r}") from None
        return cls(group=group, max_attempts=max_attempts, concurrency=concurrency,
                   batch_size=batch_size, batch_budget=_as_seconds(batch_budget),
                   gap_timeout=_as_seconds(gap_timeout),
                   gap_alert_after=None if gap_alert_after is None else _as_seconds(gap_alert_after),
                   retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                   foreign_records=foreign, start=policy,
                   dedup_window=None if dedup_window is None else _as_seconds(dedup_window),
                   unknown_event=unknown)

    def __post_init__(self) -> None:
        group = self.group
        if not isinstance(group, str) or not group.strip() or len(group) > 255:
            raise ConfigurationError(
                f"group must be a non-empty str of at most 255 characters, got {group!r}")
        _int_in("max_attempts", self.max_attempts, MAX_ATTEMPTS)
        _int_in("concurrency", self.concurrency, MAX_CONCURRENCY)
        _int_in("batch_size", self.batch_size, MAX_BATCH_SIZE)
        self._set("batch_budget", _seconds("batch_budget", self.batch_budget,
                                           "positive seconds or a timedelta", lambda s: s > 0))
        gap = _seconds("gap_timeout", self.gap_timeout, "positive seconds or a timedelta", lambda s: s > 0)
        self._set("gap_timeout", gap)
        alert = gap / 2 if self.gap_alert_after is None else _seconds(
            "gap_alert_after", self.gap_alert_after, f"positive seconds below gap_timeout ({gap:g})",
            lambda s: 0 < s < gap)
        self._set("gap_alert_after", alert)
        for name in ("retry_backoff", "retry_backoff_max"):
            self._set(name, _seconds(name, getattr(self, name), "non-negative seconds", lambda s: s >= 0))
        if not isinstance(self.foreign_records, ForeignRecords | ForeignEnvelope):
            raise ConfigurationError(f"foreign_records must be a ForeignRecords or a ForeignEnvelope, "
                                     f"got {self.foreign_records!r:.80}")
        if not isinstance(self.unknown_event, UnknownEvents):
            raise ConfigurationError(f"unknown_event must be an UnknownEvents, got {self.unknown_event!r}")
        if not isinstance(self.start, StartPolicy):
            raise ConfigurationError(f"start must be a StartPolicy, got {self.start!r}")
        if self.dedup_window is not None:
            self._set("dedup_window", _seconds("dedup_window", self.dedup_window,
                                               "positive seconds or a timedelta", lambda s: s > 0))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


DEBEZIUM = "debezium"
"""``foreign_records="debezium"``: ``ForeignEnvelope.debezium()``, Debezium's outbox event router."""


def _foreign_policy(value: object) -> ForeignRecords | ForeignEnvelope:
    if isinstance(value, ForeignEnvelope):
        return value
    if value == DEBEZIUM and isinstance(value, str):
        return ForeignEnvelope.debezium()
    if isinstance(value, str):  # a str or the enum (a str too); anything else fails below
        try:
            return ForeignRecords(value)
        except ValueError:
            pass
    raise ConfigurationError(f"foreign_records must be 'park', 'accept', {DEBEZIUM!r} or a "
                             f"ForeignEnvelope, got {value!r:.80}")


def _as_seconds(value: timedelta | float) -> float:
    """A ``timedelta`` as seconds; anything else as given, for ``__post_init__`` to judge."""
    return value.total_seconds() if isinstance(value, timedelta) else value


def _int_in(name: str, value: object, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigurationError(f"{name} must be an int from 1 to {maximum}, got {value!r}")


def _seconds(name: str, value: object, wanted: str, ok: Callable[[float], bool]) -> float:
    """``value`` as finite float seconds, if ``ok`` accepts it; else the error naming ``name``."""
    seconds = value
    if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or not _finite(seconds)
            or not ok(seconds)):
        raise ConfigurationError(f"{name} must be {wanted}, got {value!r:.80}")
    return float(seconds)


def _finite(seconds: float) -> bool:
    """Whether ``seconds`` is a finite float; an int too large for one (``10**400``) is not."""
    try:
        return math.isfinite(seconds)
    except OverflowError:
        return False


MAX_BUFFERED = 64_000
"""Deliveries held in memory at most, whatever the settings: what ``batch_size=100, concurrency=8``
allowed before ``batch_size`` became 500 by default (20 x 3,200), so the faster default did not
raise the memory a consumer may hold five times (320,000 deliveries)."""


def in_flight_limits(concurrency: int, batch_size: int) -> tuple[int, int]:
    """The poll's limits: deliveries that can run, and deliveries held in all.

    Deliveries queued behind keys that wait for a retry do not count against the
    first (they would stop the poll for every key); the second bounds memory.
    """
    runnable = max(1000, 4 * concurrency * batch_size)
    return runnable, max(runnable, min(20 * runnable, MAX_BUFFERED))
