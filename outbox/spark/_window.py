"""Time windows and durations, checked before any Spark work starts.

Jobs take their time arguments from people typing them on a command line, so
every bad value fails here with a message naming it, not halfway through a
Spark job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ..core._errors import ConfigurationError

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str | timedelta | float, what: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"24h"``, ``"7d"``, ``"1h30m"``, a timedelta or seconds; positive."""
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower().replace(" ", "")
        parts = list(_DURATION.finditer(text))
        if not parts or "".join(p.group(0) for p in parts) != text:
            raise ConfigurationError(
                f"invalid {what} {value!r}: use a number with a unit, e.g. 90s, 15m, 24h, 7d"
            )
        result = timedelta(seconds=sum(float(p.group(1)) * _UNITS[p.group(2)] for p in parts))
    else:
        raise ConfigurationError(f"invalid {what} {value!r}: expected a duration such as 24h")
    if result <= timedelta(0):
        raise ConfigurationError(f"{what} must be positive, got {value!r}")
    return result


def parse_instant(value: str | datetime, what: str) -> datetime:
    """An ISO-8601 timestamp or aware datetime, as UTC; naive input is taken as UTC."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ConfigurationError(
                f"invalid {what} {value!r}: use ISO-8601, e.g. 2026-01-31T12:00:00Z"
            ) from None
    else:
        raise ConfigurationError(f"invalid {what} {value!r}: expected a timestamp")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


@dataclass(frozen=True)
class Window:
    """A half-open time range ``[since, until)`` in UTC over messages' ``created_at``."""

    since: datetime
    until: datetime

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            moment = getattr(self, name)
            if not isinstance(moment, datetime) or moment.tzinfo is None:
                raise ConfigurationError(f"window {name} must be an aware datetime, got {moment!r}")
        if self.since >= self.until:
            raise ConfigurationError(
                f"empty window: since {self.since.isoformat()} is not before until "
                f"{self.until.isoformat()}"
            )

    @classmethod
    def parse(
        cls,
        window: Window | timedelta | str | tuple[str | datetime, str | datetime] | None,
        *,
        now: datetime,
    ) -> Window:
        """A ``Window``, a duration back from ``now`` ("24h"), a (since, until) pair, or None (all)."""
        if isinstance(window, Window):
            return window
        if window is None:
            return cls(datetime(1970, 1, 1, tzinfo=UTC), now)
        if isinstance(window, tuple):
            if len(window) != 2:
                raise ConfigurationError(f"window must be (since, until), got {window!r}")
            return cls(parse_instant(window[0], "window start"), parse_instant(window[1], "window end"))
        return cls(now - parse_duration(window, "window"), now)
