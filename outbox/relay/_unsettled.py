"""Where an exactly-once shard's transactions may have left records open, kept in its lease row.

A transaction of a shard's ``transactional.id`` that does not commit may leave its
data records open on a partition whose abort marker the broker dropped (the
partition's leader lost then). The next producer of the id must end them before it
commits there, or its commit ends them committed too: rows twice on the wire. The
Kafka transport keeps where such transactions wrote (``Unsettled``), but only in the
process; a relay stopped or killed while a partition was still leaderless took that
list with it, and the next owner, in another process, read nothing naming the
partition (its progress record names only committed transactions' topics).

So the shard's lease row names (``outbox_leases.unsettled_topics``) every topic its
transactions wrote since its last take-over: written *before* a transaction sends to
a topic not named yet (``widen``), so it outlives a relay killed at any point, and
costs no statement while the shard keeps to its topics. A take-over reads it with
its first lease confirmation (``taken``), has the new producer end what is open on
every partition of those topics, and empties it with the second (``settled``): a
settle that fails leaves the row as it was, for the next owner. Every statement is
fenced by the lease's epoch: a relay that lost the lease changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import timedelta

from sqlalchemy import Update, select, update

from ..core._envelope import utcnow
from ._leases import Leases

SEPARATOR = ","
"""Between two topics in the row: no Kafka topic name holds one (``[a-zA-Z0-9._-]``)."""


class UnsettledTopics:
    """A relay's shard leases as exactly-once mode asks them (``_shard_producer.ShardLease``):
    a renewal alone (``confirm``), or with the row's unsettled topics read (``taken``), emptied
    (``settled``) or widened (``widen``), each fenced by the epoch. Safe from any thread."""

    def __init__(self, leases: Leases) -> None:
        self._leases, self._table = leases, leases.tables.leases

    def confirm(self, shard: int, epoch: int) -> bool:
        """``Leases.confirm``: the lease of ``shard`` at ``epoch`` renewed; whether it still held."""
        return self._leases.confirm(shard, epoch)

    def taken(self, shard: int, epoch: int) -> frozenset[str] | None:
        """A take-over's first confirmation: the lease renewed and the topics its row names, in one
        transaction; None when the lease is no longer this relay's at ``epoch``."""
        leases = self._table
        with self._leases.locking() as conn:
            if conn.execute(self._renewal(shard, epoch)).rowcount != 1:
                return None
            named = conn.scalar(select(leases.c.unsettled_topics).where(leases.c.shard == shard))
        return frozenset(t for t in (named or "").split(SEPARATOR) if t)

    def settled(self, shard: int, epoch: int) -> bool:
        """A take-over's second confirmation, once the new producer ended what the row's topics may
        have held open: the lease renewed and the row emptied; whether the lease still held."""
        with self._leases.locking() as conn:
            return conn.execute(self._renewal(shard, epoch).values(unsettled_topics=None)).rowcount == 1

    def widen(self, wanted: Mapping[int, tuple[int, Collection[str]]]) -> set[int]:
        """``wanted``: shard -> (epoch, every topic its row must name): written in one transaction, each
        under its epoch, the lease renewed with it; the shards whose lease still held."""
        held: set[int] = set()
        with self._leases.locking() as conn:
            for shard, (epoch, topics) in sorted(wanted.items()):
                named = SEPARATOR.join(sorted(topics))
                if conn.execute(self._renewal(shard, epoch).values(unsettled_topics=named)).rowcount == 1:
                    held.add(shard)
        return held

    def _renewal(self, shard: int, epoch: int) -> Update:
        """The renewal of one lease at its epoch (``Leases.confirm``'s), to which a write may add."""
        leases = self._table
        # MySQL's rowcount counts matched rows here (SQLAlchemy asks for found rows).
        return update(leases).where(
            leases.c.shard == shard, leases.c.owner == self._leases.worker_id, leases.c.epoch == epoch,
        ).values(expires_at=utcnow() + timedelta(seconds=self._leases.ttl))
