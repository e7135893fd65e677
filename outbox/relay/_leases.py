"""Shard leases: how several relay processes split the outbox without sending twice in parallel.

Each relay heartbeats into ``outbox_relays``; the live relays (heartbeat within
one TTL) split ``outbox.shards`` evenly, by sorted worker id, so every relay
computes the same share for everybody. A relay takes free or expired shards up
to its share (the epoch goes up by one on every take-over), gives back shards
above its share, and renews what it holds every TTL/3. The epoch is the fencing
token every "mark published" carries (see ``_sql``). A renewal is three
statements (heartbeat; the live relays with the stored shard count, whose
change stops the relay; the renewal), the same on every dialect: a fleet runs
them for each of its tenants (``outbox.tenants._renewal``), on PostgreSQL for a
chunk of tenants in one statement (``_leases_shared``, under each tenant's
lock: ``shared_round`` / ``settle_round``).

Giving shards back happens between batches (``release_surplus``, called by the
relay's worker thread), so a shard is never released under a batch in flight;
taking and renewing happens on the lease thread, so a batch that blocks on the
broker does not let the leases lapse. All methods are safe to call from both
threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    Table,
    bindparam,
    delete,
    literal_column,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite

from transports._logsafe import safe_logger

from ..core._envelope import utcnow
from ..core._errors import SchemaError
from ..core._outage import told_if_late
from ..core._tables import MYSQL_FAMILY, OutboxTables
from ._sql import RelayStatements, statements_for

log = safe_logger("outbox.relay.leases")

SHARDS_AT_ONCE = 500
"""Shards one renewal or release statement names at most (``Leases._renew``, ``_give_back``): a relay
of 4,096 shards releases in nine. A ``(shard, epoch) IN`` of 10,000 pairs is more than PostgreSQL
parses ("stack depth limit exceeded", see ``inbox.storage._keys.SELECT_AT_ONCE``), and MariaDB turns
an ``IN`` of 1,000 values or more into a join (``in_predicate_conversion_threshold``) that no index
hint keeps on the primary key: a locking read then scans and locks every lease row."""

BY_PRIMARY_KEY = "FORCE INDEX (PRIMARY)"
"""The hint of a MySQL/MariaDB statement on lease rows named by ``shard IN (...)``: InnoDB locks every
row it reads, and unforced it reads the whole table when the list names a good part of it."""


def fair_share(shards: int, live: list[str], me: str) -> int:
    """Shards ``me`` should hold: the first ``shards % n`` live relays hold one more."""
    ordered = sorted(set(live) | {me})
    base, extra = divmod(shards, len(ordered))
    return base + (1 if ordered.index(me) < extra else 0)


@dataclass(frozen=True, slots=True)
class LeaseRound:
    """One renewal round of one relay's leases: its time, the new expiry, the shards it held."""

    now: datetime
    expires: datetime
    shards: list[int]

    def at(self, now: datetime) -> LeaseRound:
        """This round as of ``now``: a shared renewal takes many relays' locks one after another,
        and a round begun when the first was taken would renew the last for less than a TTL."""
        return LeaseRound(now, now + (self.expires - self.now), self.shards)


Answer = tuple[list[str], int | None, list[tuple[int, int]]]
"""What a heartbeat answers (``Leases.heartbeat``): the live relays, the stored shard count, the
leases renewed."""


class Leases:
    """The shard leases one relay holds, kept in step with the database."""

    def __init__(self, engine: Engine, tables: OutboxTables, shards: int, worker_id: str,
                 ttl: float) -> None:
        self._engine = engine
        self._tables = tables
        self.shards = shards
        self.worker_id = worker_id
        self.ttl = ttl
        self._owned: dict[int, int] = {}  # shard -> epoch; replaced, never mutated
        self._surplus = 0
        self._share: int | None = None  # None until the first maintain() counted the live relays
        self._lock = threading.Lock()
        self._prepared = False
        self._forget_at = datetime.min.replace(tzinfo=UTC)
        """When relays long dead are next forgotten (``_heartbeat``)."""
        self._released = False
        """``release_all`` ran: a shared renewal (``shared_round``) leaves it alone."""

    @property
    def tables(self) -> OutboxTables:
        return self._tables

    def owned(self) -> dict[int, int]:
        """A snapshot: shard -> epoch held right now."""
        # No lock: ``_owned`` is replaced, never changed in place, so reading it is
        # atomic and a batch never waits for the lease thread's database round trips.
        return dict(self._owned)

    @property
    def surplus(self) -> int:
        return self._surplus

    @property
    def share(self) -> int | None:
        """Shards this relay should hold (its fair share), as of the last ``maintain``; None before."""
        return self._share

    @property
    def _mysql(self) -> bool:
        # MySQL has no RETURNING, MariaDB none on UPDATE: those updates are followed by a
        # locking read of the rows they changed (it sees the latest rows, never a snapshot).
        return self._engine.dialect.name in MYSQL_FAMILY

    def _upsert(self, table: Table, key: str, set_: dict[str, Any]) -> Any:
        """INSERT that updates ``set_`` (or nothing, when empty) on a row with the same ``key``."""
        if self._mysql:
            ins = mysql.insert(table)
            return ins.on_duplicate_key_update(set_ or {key: ins.inserted[key]})
        module = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        ins = module.insert(table)
        if not set_:
            return ins.on_conflict_do_nothing(index_elements=[table.c[key]])
        return ins.on_conflict_do_update(index_elements=[table.c[key]], set_=set_)

    def _prepare(self) -> None:
        t = self._tables.leases
        epoch = utcnow() - timedelta(days=1)
        rows = [{"shard": s, "owner": None, "epoch": 0, "expires_at": epoch}
                for s in range(self.shards)]
        with self._engine.begin() as conn:
            conn.execute(self._upsert(t, "shard", {}), rows)
        self._prepared = True

    def maintain(self) -> dict[int, int]:
        """Heartbeat, renew, and take free shards up to the fair share; returns what is held.

        Taking shards is a transaction of its own, after the renewal's COMMIT
        (``_settle``): inside it, the take would wait on the renewal's own row locks.
        """
        with self._lock:
            self._released = False
            if not self._prepared:
                self._prepare()
            now = utcnow()
            expires = now + timedelta(seconds=self.ttl)
            with self.locking() as own:
                live, stored, renewed = self._heartbeat(own, now, expires)
            return self._settle(LeaseRound(now, expires, sorted(self._owned)), live, stored, renewed)

    @contextmanager
    def shared_round(self) -> Iterator[LeaseRound | None]:
        """What a renewal of many relays' leases in one transaction needs of this one, under its lock.

        None when it gave its leases back (``release_all``): such a renewal
        leaves it alone (its heartbeat would make the others leave it a share
        for a TTL). Inside the block, the caller renews (``heartbeat``, or one
        statement for many, ``_leases_shared``), commits, and hands the answer
        to ``settle_round``; the lock keeps a release from slipping in between.
        """
        with self._lock:
            if self._released:
                yield None
                return
            if not self._prepared:
                self._prepare()
            now = utcnow()
            yield LeaseRound(now, now + timedelta(seconds=self.ttl), sorted(self._owned))

    def heartbeat(self, conn: Connection, round_: LeaseRound) -> Answer:
        """Inside ``shared_round``: this relay's heartbeat and renewal in the caller's transaction on
        ``conn``, whose schema is this relay's (a fleet's chunk of tenants, ``tenants._renewal``)."""
        return self._heartbeat(conn, round_.now, round_.expires)

    def settle_round(self, round_: LeaseRound, live: list[str], stored: int | None,
                     renewed: list[tuple[int, int]]) -> dict[int, int]:
        """Inside ``shared_round``, after the renewal's COMMIT: what it answered, taken in (shards
        taken in a transaction of their own); returns what is held."""
        return self._settle(round_, live, stored, renewed)

    def _settle(self, round_: LeaseRound, live: list[str], stored: int | None,
                renewed: list[tuple[int, int]]) -> dict[int, int]:
        """The heartbeat's answer taken in (the caller holds the lock): lost, share, shards taken."""
        self._check_shards(stored)
        # Only leases this object took: a namesake's leases from an earlier
        # process expire and are taken afresh, with a new epoch.
        held = {s: e for s, e in renewed if self._owned.get(s) == e}
        lost = set(self._owned) - set(held)
        if lost:
            log.warning("relay %s lost shard leases %s", self.worker_id, sorted(lost))
        share = fair_share(self.shards, live, self.worker_id)
        if len(held) < share:
            held |= self._take(share - len(held), round_.now, round_.expires)
        self._owned = held
        self._share = share
        self._surplus = max(0, len(held) - share)
        return dict(held)

    @cached_property
    def _statements(self) -> RelayStatements:
        return statements_for(self._tables, self._engine.dialect.name)

    @contextmanager
    def locking(self) -> Iterator[Connection]:
        """A transaction of this relay's own that locks lease rows (and its heartbeat row), ended by
        the database if the relay stalls inside it for a TTL: frozen there (SIGSTOP, a VM stall), it
        would hold the relay that takes its expired leases (``RelayStatements.end_if_idle``)."""
        with self._engine.begin() as conn:
            self._statements.end_if_idle(conn, self.ttl)
            yield conn

    def _heartbeat(self, conn: Connection, now: datetime, expires: datetime) -> Answer:
        """This relay's heartbeat; the live relays, the stored shard count, the leases it renewed.

        Three statements a round: the heartbeat, one read of the live relays
        with the stored shard count, the renewal (a fleet on PostgreSQL runs
        them for many tenants in one statement, ``_leases_shared``). Relays
        dead for ten TTLs are forgotten once per TTL, not every round: no share
        counts them either way.
        """
        conn.execute(self._beat, {"worker_id": self.worker_id, "heartbeat_at": now})
        if now >= self._forget_at:  # long dead (killed): forget them
            self._forget(conn, now - timedelta(seconds=10 * self.ttl))
            self._forget_at = now + timedelta(seconds=self.ttl)
        live, stored = self._members(conn, now)
        self._check_shards(stored)  # before the renewal, which it rolls back
        # Only leases this object took (its renewal names them by owner and shard).
        return live, stored, (self._renew(conn, expires) if self._owned else [])

    def _forget(self, conn: Connection, before: datetime) -> None:
        """Delete the relays whose last heartbeat is before ``before``: read without a lock, then
        deleted by primary key, the condition checked again. InnoDB's DELETE by ``heartbeat_at``
        alone (no index) locked every relay's row, and two relays forgetting at once, each
        holding its own row from its heartbeat, deadlocked."""
        relays = self._tables.relays
        dead = list(conn.scalars(select(relays.c.worker_id).where(relays.c.heartbeat_at < before)))
        if dead:
            conn.execute(delete(relays).where(relays.c.worker_id.in_(dead), relays.c.heartbeat_at < before))

    def _check_shards(self, stored: int | None) -> None:
        """Resharded under a running relay (the guard was passed, or a relay started meanwhile):
        serving the old split could give one key two shards, so it stops serving anything and says why."""
        if stored is not None and stored != self.shards:
            self._owned, self._surplus = {}, 0
            raise SchemaError(
                f"the stored shard count changed from {self.shards} to {stored} "
                f"while relay {self.worker_id} ran (outbox init-db --reshard): it "
                "stops; restart it to serve the new split")

    # The statements of every round are built once (with bind parameters), not at every round: a
    # fleet runs them for each tenant, and building them cost as much as executing them.

    @cached_property
    def _beat(self) -> Any:
        """The heartbeat: insert this relay's row, or set its ``heartbeat_at``."""
        relays = self._tables.relays
        if self._mysql:
            ins = mysql.insert(relays)
            return ins.on_duplicate_key_update(heartbeat_at=ins.inserted.heartbeat_at)
        module = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        pins = module.insert(relays)
        return pins.on_conflict_do_update(index_elements=[relays.c.worker_id],
                                          set_={"heartbeat_at": pins.excluded.heartbeat_at})

    @cached_property
    def _members_query(self) -> Any:
        relays, meta = self._tables.relays, self._tables.meta
        relay, count = literal_column("0", Integer()), literal_column("1", Integer())
        return union_all(
            select(relay.label("kind"), relays.c.worker_id.label("value")).where(
                relays.c.heartbeat_at > bindparam("live_after")),
            select(count, meta.c.value).where(meta.c.name == "shard_count"),
        )

    @cached_property
    def _renewals(self) -> tuple[Any, Any]:
        """Renew this relay's leases of the shards it took (RETURNING them), and on MySQL/MariaDB
        the locking read of what it renewed.

        Both by primary key there (forced): for ``shard IN`` of half the table
        MariaDB scans all of it, and a locking read that scans waits on every row
        another transaction holds, even at READ COMMITTED. Two relays' renewals
        at once then deadlocked (each had updated its rows, each read waited on
        the other's), and at REPEATABLE READ the UPDATE locked other relays' rows
        too (``tests/test_leases.py``).
        """
        leases = self._tables.leases
        mine = (leases.c.owner == bindparam("me"), leases.c.shard.in_(bindparam("shards", expanding=True)))
        renew = update(leases).where(*mine).values(expires_at=bindparam("expires"))
        if not self._mysql:
            return renew.returning(leases.c.shard, leases.c.epoch), None
        locked = select(leases.c.shard, leases.c.epoch).where(*mine).with_for_update()
        return renew.with_hint(BY_PRIMARY_KEY), locked.with_hint(leases, BY_PRIMARY_KEY)

    def _members(self, conn: Connection, now: datetime) -> tuple[list[str], int | None]:
        """The live relays (heartbeat within one TTL) and the stored shard count, in one query."""
        rows = conn.execute(self._members_query, {"live_after": now - timedelta(seconds=self.ttl)}).all()
        live = [value for kind, value in rows if kind == 0]
        stored = [int(value) for kind, value in rows if kind == 1]
        return live, (stored[0] if stored else None)

    def _renew(self, conn: Connection, expires: datetime) -> list[tuple[int, int]]:
        """Renew the owned shards, ``SHARDS_AT_ONCE`` a statement; the (shard, epoch) renewed."""
        renew, locked = self._renewals
        owned = sorted(self._owned)
        renewed: list[tuple[int, int]] = []
        for start in range(0, len(owned), SHARDS_AT_ONCE):
            mine = {"me": self.worker_id, "shards": owned[start:start + SHARDS_AT_ONCE]}
            if locked is None:
                renewed += [(s, e) for s, e in conn.execute(renew, {**mine, "expires": expires})]
                continue
            conn.execute(renew, {**mine, "expires": expires})
            renewed += [(s, e) for s, e in conn.execute(locked, mine)]
        return renewed

    def _take(self, wanted: int, now: datetime, expires: datetime) -> dict[int, int]:
        leases = self._tables.leases
        taken: dict[int, int] = {}
        with self.locking() as conn:
            free = list(conn.scalars(
                select(leases.c.shard)
                .where((leases.c.owner.is_(None)) | (leases.c.expires_at < now),
                       leases.c.shard < self.shards)  # a removed shard's row stays (``reshard``)
                .order_by(leases.c.shard)
            ))
            for shard in free[:wanted]:
                take = (
                    update(leases)
                    .where(leases.c.shard == shard,
                           (leases.c.owner.is_(None)) | (leases.c.expires_at < now))
                    .values(owner=self.worker_id, epoch=leases.c.epoch + 1, expires_at=expires)
                )
                if not self._mysql:
                    epoch = conn.execute(take.returning(leases.c.epoch)).scalar()
                elif conn.execute(take).rowcount == 1:
                    epoch = conn.scalar(select(leases.c.epoch).where(
                        leases.c.shard == shard, leases.c.owner == self.worker_id).with_for_update())
                else:
                    epoch = None
                if epoch is not None:
                    taken[shard] = epoch
        if taken:
            log.info("relay %s took shards %s", self.worker_id, sorted(taken))
        return taken

    def confirm(self, shard: int, epoch: int) -> bool:
        """Renew this relay's lease of ``shard`` at ``epoch`` alone, now; whether it still held it.

        Exactly-once mode asks it around making a shard's producer (``_shard_producer``):
        renewed, no other relay can take the shard for a TTL, and since epochs only
        grow, none took it since this relay did. Safe from any thread.
        """
        leases = self._tables.leases
        expires = utcnow() + timedelta(seconds=self.ttl)
        with self.locking() as conn:
            # MySQL's rowcount counts matched rows here (SQLAlchemy asks for found rows).
            renewed = conn.execute(update(leases).where(
                leases.c.shard == shard, leases.c.owner == self.worker_id, leases.c.epoch == epoch,
            ).values(expires_at=expires)).rowcount
        return renewed == 1

    def release_surplus(self) -> None:
        """Give back shards above the fair share; call only between batches."""
        if self._surplus <= 0:  # the common case, without waiting for the lease thread
            return
        with self._lock:
            if self._surplus <= 0:
                return
            give = sorted(self._owned)[-self._surplus:]
            with self.locking() as conn:
                self._give_back(conn, give)
            self._given_back(give)
            self._surplus = 0

    def release_all(self) -> None:
        """Give back every shard and leave the membership table (clean shutdown), in one transaction.

        A statement for up to ``SHARDS_AT_ONCE`` shards, not one a shard: a fleet
        stopping gives back all its tenants' leases within ``RELEASE_WITHIN``, and at
        a statement a shard 500 tenants of 16 shards on one database did not. The
        membership row goes first: a heartbeat (``_heartbeat``) also takes the
        relay's row before lease rows, so the two never wait on each other in
        opposite orders.
        """
        with self._lock:
            self._released = True
            shards = sorted(self._owned)
            relays = self._tables.relays
            with self.locking() as conn:
                conn.execute(delete(relays).where(relays.c.worker_id == self.worker_id))
                self._give_back(conn, shards)
            self._given_back(shards)

    @cached_property
    def _release_statement(self) -> Any:
        """Give back the shards named, each only at the epoch this relay holds it by.

        ``shard IN`` is the primary key's, so only these rows are read and locked;
        the fence (owner, ``(shard, epoch)``) is checked on them. On MySQL/MariaDB
        the primary key is forced: InnoDB otherwise scans the whole table when the
        list names a good part of it (8 of 16 shards, MariaDB 10.11), locking every
        row it reads, other relays' too (at REPEATABLE READ until the commit): a
        release then waits on another relay's renewal in flight.
        """
        leases = self._tables.leases
        give = (
            update(leases)
            .where(leases.c.shard.in_(bindparam("shards", expanding=True)),
                   leases.c.owner == bindparam("me"),
                   tuple_(leases.c.shard, leases.c.epoch).in_(bindparam("held", expanding=True)))
            .values(owner=None, expires_at=bindparam("now"))
        )
        return give.with_hint(BY_PRIMARY_KEY) if self._mysql else give

    @cached_property
    def _lock_in_order(self) -> Any:
        """PostgreSQL: lock this relay's rows of the shards named, in shard order, before the release.

        Its UPDATE of a few rows may read the table in storage order, and a relay
        taking shards (``_take``) locks them one by one in shard order: a release
        of expired leases beside such a take deadlocked, rolling back the whole
        release. MySQL/MariaDB read the primary key (forced) in its order; SQLite
        locks the database.
        """
        if self._engine.dialect.name != "postgresql":
            return None
        leases = self._tables.leases
        return (select(leases.c.shard)
                .where(leases.c.shard.in_(bindparam("shards", expanding=True)),
                       leases.c.owner == bindparam("me"))
                .order_by(leases.c.shard).with_for_update())

    def _give_back(self, conn: Connection, shards: list[int]) -> None:
        """Give back ``shards`` in ``conn``'s transaction (``SHARDS_AT_ONCE`` a statement)."""
        now = utcnow()
        for start in range(0, len(shards), SHARDS_AT_ONCE):
            chunk = shards[start:start + SHARDS_AT_ONCE]
            if self._lock_in_order is not None:
                conn.execute(self._lock_in_order, {"shards": chunk, "me": self.worker_id})
            conn.execute(self._release_statement, {
                "shards": chunk, "me": self.worker_id, "now": now,
                "held": [(shard, self._owned[shard]) for shard in chunk]})

    def _given_back(self, shards: list[int]) -> None:
        """``shards`` were given back (committed): no longer this relay's."""
        gone = set(shards)
        self._owned = {s: e for s, e in self._owned.items() if s not in gone}
        if shards:
            log.info("relay %s released shards %s", self.worker_id, shards)


def renew_interval(ttl: float) -> float:
    return max(0.05, ttl / 3)


UNANSWERED_AT_LEAST = 5.0
"""Seconds a lease renewal may go unanswered before that is told as a database outage, whatever the
lease TTL: a shorter wait is a slow database (a lock, a checkpoint), not one that answers nothing."""


def renewal_watched(failed: Callable[[str], object], ttl: float, *,
                    unless: Callable[[], bool] | None = None) -> AbstractContextManager[None]:
    """A lease renewal the database has not answered within the lease ``ttl`` (``UNANSWERED_AT_LEAST``
    at least) is a database outage, told to ``failed`` (``told_if_late``): a frozen server fails no
    call, and the relay (or the fleet's renewal of a database) waited in silence while its leases
    lapsed. Nothing is told once ``unless()`` (the worker stopping or stopped) is true."""
    after = max(ttl, UNANSWERED_AT_LEAST)
    return told_if_late(failed, after, (
        f"no answer to a lease renewal in {after:g}s: the server frozen or cut off, or the lease "
        f"rows locked; leases past their TTL lapse"), unless=unless)

