"""Which message ids one inbox transaction found recorded already, asked a batch at a time.

Only a recorded id is a duplicate: a message at or below its key's position
whose id the group never recorded is a conflict (``_conflicts``). The
transaction's triage asks here before it decides, and asks the dedup records
(``storage.DedupRecords.known``) once for all the messages of a round that
need it, never once per message; in the steady state (every message next in
its key) it asks nothing.
"""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from ._delivery import Delivery
from .storage import DedupRecords


class RecordedIds:
    """Which message ids of one transaction the group recorded already, looked up a batch at a time."""

    def __init__(self, dedup: DedupRecords) -> None:
        self._dedup = dedup
        self._asked: set[uuid.UUID] = set()
        self._found: set[uuid.UUID] = set()

    def look_up(self, session: Session, deliveries: list[Delivery]) -> None:
        """One statement for all of ``deliveries`` (none when it is empty: the steady state)."""
        if deliveries:
            self._asked.update(d.message.message_id for d in deliveries)
            self._found |= self._dedup.known(session, deliveries)

    def looked_up(self, message_id: uuid.UUID) -> bool:
        return message_id in self._asked

    def recorded(self, message_id: uuid.UUID) -> bool:
        return message_id in self._found
