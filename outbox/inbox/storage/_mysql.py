"""The inbox's stores on MySQL and MariaDB, which have neither ``ON CONFLICT`` nor ``RETURNING``.

"Insert unless present" is ``INSERT … ON DUPLICATE KEY UPDATE`` with a no-op
assignment (``_inserts.OnDuplicateKey``). Dedup rows go in one multi-row
``INSERT`` (InnoDB undoes just that statement when it meets a duplicate key) and,
only when that meets a duplicate key, row by row, each in its own savepoint: so the
caller learns which ids were new without ``RETURNING``. Every executemany here is an ``INSERT``, which the
driver sends as one multi-row statement (an executemany of ``UPDATE``\\ s is a
round trip per row).

Keys are locked, and their held successors found, through a join from
``JSON_TABLE(:keys)``: one index lookup per key, in the order given. The plain ``(topic, key) IN (…)`` is
planned as a scan of the whole group once a batch names a good part of its
keys, and a ``FOR UPDATE`` scan waits for every row another worker holds:
two workers then run one after the other (and deadlock now and then). An OR
of one range per key, 200 keys a statement, cost the optimizer some 8 ms a
statement on MariaDB 10.11, two statements a batch of 400 keys.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    DateTime,
    Integer,
    Row,
    String,
    and_,
    bindparam,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ...core._envelope import utcnow
from ...core._mysql import json_rows, json_table
from ...core._tables import InboxOutcome, OutboxTables, name_collation
from .._delivery import Delivery, KeyId
from ._dedup import DedupTable
from ._held import HeldTable
from ._inserts import MYSQL_INSERTS
from ._keys import KeysTable, KeyState
from ._parked import ParkedTable
from ._storage import InboxStorage

ER_DUP_ENTRY = 1062

# The per-message columns of inbox_messages, as ``claim`` sends them (the rest are constants).
_CLAIMS: dict[str, Any] = {
    "message_id": String(), "topic": String(), "key": String(), "seq": BigInteger(),
    "kafka_partition": Integer(), "kafka_offset": BigInteger(), "created_at": DateTime(),
    "received_at": DateTime(),
}


def _keys_table(session: Session, param: str, **seqs: BigInteger | String) -> Any:
    """``JSON_TABLE(:param)`` of ``[topic, key, *seqs]`` rows, to join on.

    The key columns take the tables' collation (``name_collation``), so the join
    compares keys exactly as the tables do: ``"A"`` is not ``"a"``. Asked of the
    session's connection, not its engine: an engine that has not connected yet does not
    know MariaDB from MySQL 8 (an async one's first statement named MySQL 8's collation on
    MariaDB, error 1273).
    """
    collation = name_collation(session.connection().dialect)
    return json_table(param, {"topic": String(), "key": String(), **seqs}, name="wanted", sql_types={
        "topic": f"VARCHAR(249) CHARACTER SET utf8mb4 COLLATE {collation}",
        "key": f"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation}"})


class MySQLKeys(KeysTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, MYSQL_INSERTS)

    def lock(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        found = self._lock_existing(session, wanted)
        if len(found) < len(wanted):
            have = {(topic, key) for topic, key, *_ in found}
            missing = [key for key in wanted if key not in have]
            self._create(session, missing)
            found += self._lock_existing(session, missing)
        # Unpacked: a Row's attribute access costs more than the rest of the loop.
        return {(topic, key): KeyState(last_seq, parked, started, incarnation)
                for topic, key, last_seq, parked, started, incarnation in found}

    def _lock_existing(self, session: Session, keys: Sequence[KeyId]
                       ) -> list[tuple[str, str, int, bool, int | None, str | None]]:
        """Lock and read ``keys`` (topic, key, last_seq, parked, started_at_seq, incarnation) that exist."""
        k = self.t.inbox_keys
        wanted = _keys_table(session, "keys")
        stmt: Any = (
            select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked, k.c.started_at_seq, k.c.incarnation)
            .select_from(wanted.join(k, and_(k.c.consumer_group == self.group,
                                              k.c.topic == wanted.c.topic, k.c.key == wanted.c.key)))
            .with_for_update()
        )
        rows = session.execute(stmt, {"keys": json.dumps(keys)}).all()
        return cast(list[tuple[str, str, int, bool, int | None, str | None]], rows)

    def advance(self, session: Session, seqs: dict[KeyId, int],
                incarnations: Mapping[KeyId, str] | None = None) -> None:
        """Advance keys whose rows exist and are locked (lock ran first): one joined UPDATE.

        A key in ``incarnations`` records that producer incarnation; a JSON null keeps the key's.
        """
        if not seqs:
            return
        incarnations = incarnations or {}
        k = self.t.inbox_keys
        wanted = _keys_table(session, "seqs", last_seq=BigInteger(), incarnation=String())
        stmt = (update(k)
                .where(k.c.consumer_group == self.group, k.c.topic == wanted.c.topic, k.c.key == wanted.c.key)
                .values(last_seq=wanted.c.last_seq,
                        incarnation=func.coalesce(wanted.c.incarnation, k.c.incarnation)))
        session.execute(stmt, {"seqs": json.dumps([[t, key, seq, incarnations.get((t, key))]
                                                   for (t, key), seq in seqs.items()])})


class MySQLDedup(DedupTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, MYSQL_INSERTS)
        m = tables.inbox_messages
        # The batch's dedup rows from one JSON parameter (``_mysql.json_table``), not a
        # multi-row INSERT, whose values the driver quotes one by one in Python.
        claims = json_table("rows", _CLAIMS)
        self._claim = insert(m).from_select(
            ["consumer_group", *_CLAIMS, "processed_at", "deliveries", "outcome"],
            select(literal(group), *claims.c, bindparam("now", type_=m.c.processed_at.type),
                   literal(1), literal(InboxOutcome.PROCESSED.value)))

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        if not deliveries:
            return set()
        now = utcnow()
        try:
            # No savepoint: InnoDB rolls back only the statement that meets a duplicate key
            # (error 1062), never the transaction, so the batch's earlier writes stand and
            # the rows go again one by one. A savepoint here cost two round trips a batch.
            rows = [(d.message.message_id.hex, d.message.topic, d.message.key, d.message.seq,
                     d.partition, d.offset, d.message.created_at, d.received_at) for d in deliveries]
            session.execute(self._claim, {"rows": json_rows(rows), "now": now})
            return {d.message.message_id for d in deliveries}
        except IntegrityError as exc:
            if not _duplicate_key(exc):
                raise
        m = self.t.inbox_messages
        new: set[uuid.UUID] = set()
        for d in deliveries:
            try:
                with session.begin_nested():
                    session.execute(insert(m), self.done_row(d, now))
                new.add(d.message.message_id)
            except IntegrityError as exc:
                if not _duplicate_key(exc):
                    raise
        return new


class MySQLHeld(HeldTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, MYSQL_INSERTS)

    def _rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        h = self.t.inbox_held
        wanted = _keys_table(session, "ranges", first_seq=BigInteger(), last_seq=BigInteger())
        stmt = select(h).select_from(wanted.join(h, and_(
            h.c.consumer_group == self.group, h.c.topic == wanted.c.topic, h.c.key == wanted.c.key,
            h.c.seq >= wanted.c.first_seq, h.c.seq <= wanted.c.last_seq)))
        params = json.dumps([[t, key, first, last] for (t, key), (first, last) in ranges.items()])
        return list(session.execute(stmt, {"ranges": params}).all())


def mysql_storage(tables: OutboxTables, group: str) -> InboxStorage:
    """The inbox's storage of ``group`` on MySQL or MariaDB."""
    return InboxStorage(group, MySQLDedup(tables, group), MySQLKeys(tables, group),
                        MySQLHeld(tables, group), ParkedTable(tables, group, MYSQL_INSERTS))


def _duplicate_key(error: IntegrityError) -> bool:
    args: tuple[Any, ...] = getattr(error.orig, "args", ())
    return bool(args) and args[0] == ER_DUP_ENTRY
