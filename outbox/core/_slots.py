"""``Slots``: how many threads one database may hold at once: a database that hangs keeps the rest free.

A database that is *down* fails fast and closes its ``OutageGate``
(``_outage``). One that *hangs* (a frozen host, a partition that drops packets)
never fails: every thread whose statement reaches it waits as long as the
driver does. Threads shared by several databases' work (the inbox's workers,
the relay fleet's workers and writers) are kept from it by a count per
database: a caller takes a slot before its work touches the database and gives
it back after; ``take`` never waits, a caller that gets none puts the work off.
The inbox and the relay fleet both key the slots by the database's server, as it
says it is (``_identity``'s dialect and server: the databases of one server
hang together), or, until it was asked, by what they know the database by (the
inbox: its engine's pool, ``inbox._tenant_places``; the fleet: its database,
``tenants._slots``).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable


class Slots:
    """How many of ``workers`` threads each database may hold at once: a hung database keeps the rest free.

    ``span`` sizes the limit by how many databases the work spans. ``take``
    never waits: a caller that gets no slot puts its work off. Thread-safe.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.limit = workers
        self._lock = threading.Lock()
        self._taken: dict[Hashable, int] = {}

    def span(self, databases: int) -> None:
        """The limit for work spanning ``databases``: one has nothing to keep free from it, so it may
        hold every thread; of several, each holds half the threads at most (at least one)."""
        self.limit = self.workers if databases <= 1 else max(1, self.workers // 2)

    def take(self, database: Hashable) -> bool:
        with self._lock:
            taken = self._taken.get(database, 0)
            if taken >= self.limit:
                return False
            self._taken[database] = taken + 1
            return True

    def give_back(self, database: Hashable) -> None:
        with self._lock:
            left = self._taken[database] - 1
            if left:
                self._taken[database] = left
            else:
                del self._taken[database]
