"""The inbox's settings of the shared outage rules (``outbox.core._outage``): its logger and its pacing.

An outage never counts as a handler attempt, never parks, never alerts and
never ends the consumer: the work waits with capped, jittered backoff and is
tried again as it is. What counts as one (``is_outage``, ``is_handler_outage``)
and how it is logged and paced live in ``outbox.core._outage``, shared with the relay.
"""

from __future__ import annotations

from transports._logsafe import safe_logger

from ..core._outage import INBOX_WORDING, OutageBackoff, OutageTracker
from ..core._outage import Outage as Outage
from ..core._outage import is_handler_outage as is_handler_outage
from ..core._outage import is_missing_schema as is_missing_schema
from ..core._outage import is_outage as is_outage

log = safe_logger("outbox.inbox")

BACKOFF = OutageBackoff(first=0.2, jitter=0.25)
"""0.2 s, doubling up to 5 s, each cut by up to a quarter at random: workers do not all knock at once."""


class OutageLog(OutageTracker):
    """An ``OutageTracker`` with the inbox's logger, wording and pacing; safe to call from several threads."""

    def __init__(self, what: str = "the database") -> None:
        super().__init__(what, log=log, wording=INBOX_WORDING, backoff=BACKOFF)
