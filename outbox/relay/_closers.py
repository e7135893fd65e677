"""``Closers``: leases given back on threads of their own, waited for within ``RELEASE_WITHIN``.

A stop gives its leases back, and the database may hold that release for as
long as it likes: frozen, or its lease table locked by another transaction (a
migration's ``LOCK TABLE``), with the relay's own renewal queued on the lock
before it. Waiting for it held the stop until its own bound, whose last line
("… did not finish within 10s …") never said which leases were left behind.
A release at the stop gets nothing by waiting longer: the leases expire within
their TTL either way. So each group of releases (one database's) runs on a
closer thread, and the stop waits for all of them at most ``RELEASE_WITHIN``
seconds; what is not given back by then goes on on its closer, and the stop
says so. A ``Relay`` closes its one step so, a ``TenantRelay`` its tenants
(``tenants._fleet_tenants``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

from transports._logsafe import safe_logger

log = safe_logger("outbox.relay")

RELEASE_WITHIN = 3.0
"""Seconds a stop, ``close()`` or a fleet's refresh that removed tenants waits for leases to be given
back, all databases at once."""

T = TypeVar("T", bound=Hashable)


class Closers(Generic[T]):
    """The closer threads giving items back (``close(item)``: True when it gave them back). Thread-safe.

    ``late(items, seconds)`` is told the items a closer gave back after the
    bound, so that a stop that said they were not can be corrected.
    """

    def __init__(self, close: Callable[[T], bool], *,
                 late: Callable[[list[T], float], None] | None = None) -> None:
        self._close = close
        self._late = late
        self._lock = threading.Lock()
        """Guards ``_closers``."""
        self._closers: dict[T, threading.Thread] = {}
        """The items a closer is giving back, until it has: a second call waits for that thread
        instead of starting another on them."""

    def close_within(self, items: Sequence[T], *, group: Callable[[T], Hashable | None],
                     at_once: Callable[[T], object] | None = None) -> set[T]:
        """Close ``items``, waiting at most ``RELEASE_WITHIN`` seconds; the items still being closed.

        Items of one ``group(item)`` go to one closer, one after the other (one
        database's: a frozen one holds only its own). An item an earlier call's
        closer still gives back is waited for (within the bound), not given back
        by a second closer beside the first. An item whose group is None has
        nothing to give back on a closer: ``at_once`` closes it on the caller's
        thread, once the closers have started (the closers' ``close`` when it is None).
        """
        started = time.monotonic()
        groups: dict[Hashable, list[T]] = {}
        earlier: list[threading.Thread] = []
        here: list[T] = []
        with self._lock:
            for item in items:
                if item in self._closers:
                    earlier.append(self._closers[item])
                elif (key := group(item)) is not None:
                    groups.setdefault(key, []).append(item)
                else:
                    here.append(item)
            closers = [threading.Thread(target=self._close_group, args=(members, started),
                                        name="outbox-relay-release", daemon=True)
                       for members in groups.values()]
            for closer, members in zip(closers, groups.values(), strict=True):
                self._closers.update(dict.fromkeys(members, closer))
                closer.start()  # under the lock: a call after this one joins only started closers
        for item in here:
            (at_once or self._close)(item)
        deadline = started + RELEASE_WITHIN
        for closer in dict.fromkeys([*closers, *earlier]):
            closer.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return {item for item in items if item in self._closers}

    def going(self) -> list[T]:
        """The items a closer is giving back now."""
        with self._lock:
            return list(self._closers)

    def _close_group(self, group: list[T], started: float) -> None:
        late = []
        for item in group:
            try:
                given = self._close(item)
            except Exception:  # a bug: the others of its group are closed still
                log.exception("could not close %r", item)
                given = False
            finally:
                with self._lock:
                    del self._closers[item]
            if given and time.monotonic() - started > RELEASE_WITHIN:
                late.append(item)
        if late and self._late is not None:
            self._late(late, time.monotonic() - started)
