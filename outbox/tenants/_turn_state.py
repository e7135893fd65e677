"""``TurnState``: where a fleet's tenant is in its turn, as an enum rather than strings.

``TenantRelay`` (``_relay``) serves a tenant on one worker at a time: it waits
(``IDLE``), is queued, or runs one step. Defined here, below the fleet, for the
fleet's scheduler (``_schedule``) to import (issue 35: its strings "idle",
"queued", "running" stood beside no enum). A ``StrEnum``: a member is its
value, so what reads the strings (a test, a log) reads the same.
"""

from __future__ import annotations

import enum


class TurnState(enum.StrEnum):
    """Where a tenant is in its turn; it is never run by two workers at once."""

    IDLE = "idle"
    """Waiting for a notification, a retry timer or its poll."""
    QUEUED = "queued"
    """In the queue of woken tenants or of polled ones: a worker takes it next."""
    RUNNING = "running"
    """On a worker, for one step."""
