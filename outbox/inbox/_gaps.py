"""Held messages that need a nudge: gaps that filled elsewhere, and gaps that never fill.

A held message is normally applied right after its predecessor, in the same
transaction. Two cases need a periodic sweep instead: the predecessor was
applied by another consumer (a key whose records sit on two partitions owned
by different processes), and the predecessor never comes. After
``gap_timeout`` the key is parked with reason ``gap``: the first held message
carries the reason, the others are parked behind it, and the alert sink hears
of it once. Before that, after ``alert_after``, a gap still held raises one
``gap_held`` alert (per head message and process): the missing message may
still be on its way — a slow relay, a broker outage — and someone can look
before the key parks.

The sweep's reads, every second, are also how the inbox learns that its database answers nothing
(a frozen host, a partition that drops packets): such a server fails no call, so a transaction on
it just waits, in silence. A read unanswered for ``UNANSWERED`` seconds is told as an outage; the
first read begun after that and answered ends it. Only that outage: one a transaction told (a full
disk fails writes, not reads) is the transactions' to end, or every sweep would end it again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from ..core._alerts import Alert, AlertKind, deliver
from ..core._envelope import utcnow
from ..core._outage import OutageTracker, told_if_late
from ._alerting import Alerter
from ._committed import Parked
from ._conflicts import Verdict, describe
from ._delivery import Delivery, KeyId, OrderedDelivery
from ._kinds import Reason
from ._sessions import Sessions
from .storage import InboxStorage, KeyState

T = TypeVar("T")

UNANSWERED = 10.0
"""Seconds a sweep's read may go unanswered before the database is told down: the connect timeout
(``core._engine.CONNECT_TIMEOUT``), so that a frozen server is told as soon on a pooled connection as
on a new one. The reads take no lock: only a server that answers nothing keeps one waiting that long."""


class GapSweeper:
    """Finds and settles held messages for one group; safe to call from several threads.

    Database errors propagate: the caller decides whether to wait (an outage).
    The database work runs through ``Sessions.run``; alerts go out from the
    calling thread. ``outages`` (the inbox's database) hears of a read left
    unanswered (module doc) and of the next one answered; not once the inbox's run
    that the read began in is stopping or returned (``run_over()``, called as the read
    begins): a read still hanging then tells nothing.
    """

    _unanswered_since: float | None = None
    """When a read left unanswered was told (``_told``): the outage the sweep's reads may end."""

    def __init__(self, sessions: Sessions, storage: InboxStorage, alerter: Alerter,
                 gap_timeout: float, alert_after: float, outages: OutageTracker,
                 run_over: Callable[[], Callable[[], bool]] | None = None) -> None:
        self.sessions = sessions
        self.outages = outages
        self._run_over = run_over
        self.storage = storage
        self.alerter = alerter
        self.gap_timeout = gap_timeout
        self.alert_after = alert_after
        self._alerted: set[uuid.UUID] = set()  # head message ids of gaps already alerted on

    def ready(self, limit: int = 500) -> list[OrderedDelivery]:
        """Held messages that are next in their key; apply each through its key's lane."""
        return self._read(self._ready, limit)

    def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a read, told to ``outages`` if unanswered for ``UNANSWERED`` seconds."""
        return self.watched(lambda: self.sessions.run(fn, *args))

    def watched(self, read: Callable[[], T]) -> T:
        """``read()``, a read of the sweep's (its own, or the parked keys' count after it), told to
        ``outages`` if unanswered for ``UNANSWERED`` seconds: a read the server froze under that went
        unwatched hung the sweep for good, and its later reads, which would have told it, never came."""
        started = time.monotonic()
        with told_if_late(self._told, UNANSWERED, (
                f"no answer to the gap sweep's read in {UNANSWERED:g}s: the server frozen or cut off"),
                unless=None if self._run_over is None else self._run_over()):
            found = read()
        since = self._unanswered_since
        if since is not None and started > since:
            self._unanswered_since = None
            self.outages.answered(started)
        return found

    def _told(self, why: str) -> None:
        # Taken over only when the watch tells it: an outage the transactions told (a full disk
        # fails writes, not reads) is theirs to end, though a read was slow meanwhile (a lock).
        if not self.outages.down:
            self._unanswered_since = time.monotonic()
        self.outages.failed(why)

    def _ready(self, limit: int) -> list[OrderedDelivery]:
        with self.sessions() as session:
            return self.storage.held.ready(session, limit)

    def warn_held(self) -> int:
        """One ``gap_held`` alert per gap held longer than ``alert_after`` (not yet parked); how many new."""
        now = utcnow()
        states, heads = self._read(self._heads, now - timedelta(seconds=self.alert_after))
        current, raised = set(), 0
        for key, head, waiting in heads:
            state = states.get(key)
            last_seq = state.last_seq if state is not None else 0
            if head.message.seq is None or head.message.seq <= last_seq + 1:
                continue  # the gap filled meanwhile (the sweep applies it) or it is a stale copy
            current.add(head.message.message_id)
            if head.message.message_id in self._alerted:
                continue
            held_for = (now - head.received_at).total_seconds()
            missing = f"seq {last_seq + 1}" + (f" to {head.message.seq - 1}"
                                               if head.message.seq - 1 > last_seq + 1 else "")
            deliver(self.alerter.sink, Alert(
                kind=AlertKind.GAP_HELD, topic=head.message.topic, key=head.message.key,
                message_id=str(head.message.message_id), group=self.alerter.group,
                tenant=self.alerter.tenant,
                error=f"{missing} missing; seq {head.message.seq} held for {held_for:.0f}s",
                details={"seq": head.message.seq, "missing_from": last_seq + 1, "waiting": waiting,
                         "held_for_s": round(held_for, 1),
                         "parks_in_s": round(max(0.0, self.gap_timeout - held_for), 1)}))
            raised += 1
        self._alerted = current  # a gap that filled or parked is forgotten
        return raised

    def _heads(self, before: datetime) -> tuple[dict[KeyId, KeyState],
                                                list[tuple[KeyId, Delivery, int]]]:
        """Key states and first held messages of the gaps held since before ``before``."""
        with self.sessions() as session:
            keys = self.storage.held.stale(session, before)
            states = self.storage.keys.states(session, keys)
            return states, [(key, held[0], len(held)) for key in keys
                            if (held := self.storage.held.of_key(session, key))]

    def park_stale(self) -> int:
        """Warn about gaps held past ``alert_after``; park keys whose gap outlived ``gap_timeout``."""
        self.warn_held()
        cutoff = utcnow() - timedelta(seconds=self.gap_timeout)
        parked = 0
        for key in self._read(self._stale, cutoff):
            found = self.sessions.run(self._park_gap, key, cutoff)
            if found is not None:
                parked += 1
                self.alerter.parked([found])
        return parked

    def _stale(self, cutoff: datetime) -> list[KeyId]:
        with self.sessions() as session:
            return self.storage.held.stale(session, cutoff)

    def _park_gap(self, key: KeyId, cutoff: datetime) -> Parked | None:
        """Park ``key`` if its gap is still there, in one transaction; what was parked."""
        with self.sessions() as session, session.begin():
            state = self.storage.keys.lock(session, [key])[key]
            held = self.storage.held.of_key(session, key)
            # A held copy of a seq applied meanwhile (it came again on another path) is a
            # duplicate; a held message with another id at such a seq is a conflict.
            stale = [d for d in held if d.seq <= state.last_seq]
            recorded = self.storage.dedup.known(session, stale)
            self.storage.held.remove(session, (d.message.message_id for d in stale
                                               if d.message.message_id in recorded))
            conflicting = [d for d in stale if d.message.message_id not in recorded]
            if conflicting:
                head = conflicting[0]
                reason = Reason.KEY_PARKED if state.parked else Reason.SEQ_CONFLICT
                error = describe(Verdict.SEQ_CONFLICT, head, state)
                return Parked(head, reason, error, self.storage.park(session, head, reason, error=error))
            held = held[len(stale):]
            if state.parked or not held or held[0].received_at >= cutoff:
                return None  # settled meanwhile
            head = held[0]
            expected = state.last_seq + 1
            if head.message.seq == expected:
                return None  # the gap filled: ready(), not parking
            last_missing = head.seq - 1
            missing = f"seq {expected}" + (f" to {last_missing}" if last_missing > expected else "")
            error = (f"{missing} did not arrive within {self.gap_timeout:g}s "
                     f"(seq {head.message.seq} waiting since {head.received_at.isoformat()})")
            key_parked = self.storage.park(session, head, Reason.GAP, error=error)
        return Parked(head, Reason.GAP, error, key_parked)
