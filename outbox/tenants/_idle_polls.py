"""How soon an idle tenant is polled again: rarely while notifications can wake it, else every interval.

A poll of a tenant that has nothing to send is a fetch; 500 tenants polled
every 5 s were 100 fetches a second and about a third of a core with nothing
sent (docs/benchmarks.md, "Many tenants"). The leases are renewed per database
(``_renewal``), so a poll protects only what no notification announces:

- a row whose delay comes due (``publish(delay=...)``, a retry written by a
  relay that died): the tenant's step says when (``RelayStep.poll_within``),
  and it is polled by then, whatever its backoff;
- its stuck-key check, due every ``key_stuck_after / 5``: the same;
- a notification lost while the LISTEN connection was down: every tenant of
  the database is polled when it breaks and again when it is back
  (``_databases``), and every ``poll_interval`` while it is down;
- a row written without a notification (a writer with ``notify_channel=None``,
  raw SQL): found by the next poll, at most ``MAX_IDLE_POLL`` seconds later.

A poll is one transaction: the fetch, and when it found every row due (it
was not full) the look at the delayed rows and (when due) the stuck keys on
its connection (``RelayStep.run(look_ahead=True)``); a turn that sent a
tenant's last rows reads the same there.

So while its database's listener is connected, a tenant's polls back off,
doubling from ``poll_interval`` up to ``MAX_IDLE_POLL`` with each turn, and
start again from ``poll_interval`` only when a poll found rows (and stay
there through the full batches that drain them, until a turn comes back
empty: ``Unit.unannounced``): those may come from a writer that never
notifies, whose next rows the next poll serves.
Rows a notification announced need no poll after them. Reset after every
turn with work, a fleet draining 500 tenants' rows polled each of them again
every ``poll_interval`` while the others drained (an empty fetch and a
look-ahead each), and a tenant sent a message a minute was polled 2, 6, 14
and 30 s after each (docs/benchmarks.md, *Many tenants: the polls after a notified turn*).
What a turn with work leaves for later (a retry in its wheel, a write of its
outcomes that failed) wakes the tenant on its own (``Step.due``,
``_slots._SlottedWriter``).

Each delay is shortened by up to ``JITTER`` of itself, at random: the tenants
of a fleet start together, and with equal delays their polls stayed together,
a burst of hundreds of fetches once a minute that whatever else the fleet and
the database serve then (a quiet tenant's message) waits behind. Only
shortened, so no bound above is ever passed.
Where no notification can come (MySQL, MariaDB, SQLite, ``notify_channel=None``,
the listener down), every tenant is polled every ``poll_interval`` as before.
"""

from __future__ import annotations

import random
from typing import Protocol

MAX_IDLE_POLL = 60.0
"""Seconds between two polls of an idle tenant at most, while notifications can wake it: the worst
extra latency of a row written without a notification (never below ``poll_interval``)."""

JITTER = 0.25
"""The most of a delay cut off at random, so that the polls of tenants started together spread out."""


class Idling(Protocol):
    """What the polls read and write of a tenant (``Unit.idle_turns``)."""

    idle_turns: int


class IdlePolls:
    """When a tenant is polled next; its count of idle turns is its own (``Unit.idle_turns``)."""

    def __init__(self, every: float, cap: float = MAX_IDLE_POLL, *, rng: random.Random | None = None) -> None:
        self.every = every
        self.cap = max(every, cap)
        self._rng = rng or random.Random()

    def after_turn(self, unit: Idling, *, unannounced: bool, notified: bool) -> float:
        """Seconds until ``unit``'s next poll after a turn; ``unannounced``: it was a poll and found rows.

        ``notified``: its database's notifications reach the fleet now. Longer
        than ``every`` only when they do: the caller then asks the tenant's step
        how long it may wait (``RelayStep.poll_within``).
        """
        if unannounced or not notified:
            unit.idle_turns = 0
            delay = self.every
        else:
            unit.idle_turns = min(unit.idle_turns + 1, 32)
            delay = min(self.cap, self.every * (1 << unit.idle_turns))
        return delay * (1.0 - JITTER * self._rng.random())
