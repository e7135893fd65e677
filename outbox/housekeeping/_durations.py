"""Retention periods as people type them (``7d``, ``36h``, ``90m``), checked before any SQL runs."""

from __future__ import annotations

import re
from datetime import timedelta

from ..core._errors import ConfigurationError

_PART = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d|w)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_PERIOD = timedelta(days=100 * 365)
"""The longest period taken: a cutoff further back than this is no retention (and before year 1
it cannot be computed at all)."""


def parse_period(value: str | timedelta | float, what: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"24h"``, ``"7d"``, ``"1d12h"``, a timedelta or seconds; positive,
    at most ``MAX_PERIOD``."""
    try:
        result = _period(value, what)
    except (OverflowError, ValueError):  # seconds past timedelta's range, NaN, infinity
        result = MAX_PERIOD + MAX_PERIOD
    if result <= timedelta(0):
        raise ConfigurationError(f"{what} must be positive, got {value!r}")
    if result > MAX_PERIOD:
        raise ConfigurationError(f"{what} must be at most {MAX_PERIOD.days} days, got {value!r}")
    return result


def _period(value: str | timedelta | float, what: str) -> timedelta:
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if value != value:  # NaN compares unequal to everything, zero included
            raise ConfigurationError(f"{what} must be positive, got {value!r}")
        result = timedelta(seconds=value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower().replace(" ", "")
        parts = list(_PART.finditer(text))
        if not parts or "".join(p.group(0) for p in parts) != text:
            raise ConfigurationError(f"invalid {what} {value!r}: use a number with a unit, "
                                     f"e.g. 90s, 15m, 24h, 7d")
        result = timedelta(seconds=sum(float(p.group(1)) * _UNITS[p.group(2)] for p in parts))
    else:
        raise ConfigurationError(f"invalid {what} {value!r}: expected a duration such as 7d")
    return result
