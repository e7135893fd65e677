"""What a handler can raise to steer the inbox, and what the inbox reports back.

A plain exception means "this failed": the inbox retries it and parks it after
``max_attempts``. Where that is the wrong signal, a handler raises one of these
instead (FastStream's ``NackMessage`` / ``SkipMessage`` in inbox terms). Each
one rolls back the handler's own writes first.
"""

from __future__ import annotations

import enum

from ..core._errors import OutboxError


class HandlerSignal(OutboxError):
    """Base of the exceptions a handler raises on purpose."""


class RetryLater(HandlerSignal):
    """Not now, but nothing is wrong: try again after ``delay`` seconds.

    Does not count as a failed attempt, so it never parks the key (e.g. a
    downstream service answered "busy"). The key waits; other keys go on.
    """

    def __init__(self, delay: float = 1.0, reason: str = "") -> None:
        if delay < 0:
            raise ValueError(f"RetryLater delay must not be negative, got {delay!r}")
        super().__init__(reason or f"retry in {delay}s")
        self.delay = delay


class SkipMessage(HandlerSignal):
    """Do not apply this message, and do not try again: record it as skipped.

    The key moves past it (its ``seq`` counts as consumed), and the
    ``inbox_messages`` row keeps ``outcome='skipped'`` with the reason.
    """


class ParkMessage(HandlerSignal):
    """This message can never succeed as it is: park it (and its key) now.

    Skips the remaining attempts, e.g. for a payload that fails validation.
    """


class Disposition(enum.Enum):
    """What became of one delivery handed to the inbox."""

    APPLIED = "applied"
    """The handler's writes committed together with the dedup record."""
    DUPLICATE = "duplicate"
    """Already applied before (same message id, or seq not ahead of the key's)."""
    HELD = "held"
    """Arrived ahead of a gap in its key's seq; stored until the gap fills."""
    PARKED = "parked"
    """Stored in ``inbox_parked``: it failed, could not be decoded, or its key is parked."""
    SKIPPED = "skipped"
    """The handler raised ``SkipMessage``; recorded, not applied."""
