"""One retention batch on PostgreSQL: a pick of the next settled keys and a delete of those rows.

Two ways, by what may lock a settled row:

- ``unlocked_batch`` (rows nothing writes once settled: a published outbox
  row, which the relay never marks again and an operator's actions never
  select): the pick and the delete are one statement that sends no key to the
  client, and the pick takes no row lock. The delete itself waits for a row
  another transaction holds (another retention run deleting the same batch,
  an operator's own SQL) and then checks the settled conditions again on the
  row as that transaction left it: a row gone is not counted, a row no longer
  settled is kept. It waits at most ``UNLOCKED_WAIT``; past that the batch rolls
  back and the caller runs it as a ``locked_batch``, which passes over the row.
- ``locked_batch`` (rows someone may lock: an inbox counting a redelivery
  locks its record): ``SELECT … FOR UPDATE SKIP LOCKED`` first, then a delete
  of the picked keys.

Measured on 300,000 rows on pages just checkpointed (the benchmark machine, alternating): the
locking pick writes a row lock before the delete writes again, 342 bytes of WAL a row against
286, and with the keys' round trip through the client it cost 3.2 µs of CPU a row (database and
client) against 2.3 (docs/operations.md, "Housekeeping").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, Engine, Select, any_, cast, delete, func, literal, select, text, tuple_
from sqlalchemy.exc import DBAPIError

from ..core._pg_arrays import array_params, rows_of
from ._targets import Target

UNLOCKED_WAIT = "200ms"
"""How long an unlocked batch's delete waits for a row someone else holds before the batch is run
again with the locking pick, which passes over it. Another retention run's batch holds its rows
for a few milliseconds."""
LOCK_NOT_AVAILABLE = "55P03"

Batch = tuple[int, tuple[Any, ...] | None, int]
"""How many rows a batch picked, the last one's key (the next batch starts after it) and how many
it deleted."""


def pg_batch(engine: Engine, target: Target, cutoff: datetime, size: int,
             after: Sequence[Any] | None) -> Batch:
    """The next batch of ``target``: unlocked when its settled rows are final, else locked.

    ``engine`` is a worker's (``core._engine.worker_engine``): its transactions are real ones also
    when the application made its engine AUTOCOMMIT, where each statement committed on its own,
    ``SET LOCAL lock_timeout`` bounded nothing (an unlocked batch waited for a held row for as long
    as its holder held it) and a locking pick's row locks were gone before its delete.
    """
    if target.final:
        try:
            return unlocked_batch(engine, target, cutoff, size, after)
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
    return locked_batch(engine, target, cutoff, size, after)


def unlocked_batch(engine: Engine, target: Target, cutoff: datetime, size: int,
                   after: Sequence[Any] | None) -> Batch:
    """One transaction of ``unlocked_statement``, waiting at most ``UNLOCKED_WAIT`` for a row."""
    with engine.begin() as conn:
        conn.execute(text(f"SET LOCAL lock_timeout = '{UNLOCKED_WAIT}'"))
        found, last, deleted = conn.execute(unlocked_statement(target, cutoff, size, after)).one()
    return (found, (last,), deleted) if found else (0, None, 0)


def unlocked_statement(target: Target, cutoff: datetime, size: int,
                       after: Sequence[Any] | None) -> Select[Any]:
    """The next ``size`` settled keys after ``after`` as one array, then the delete of those rows.

    The pick is an ``ARRAY(SELECT … LIMIT n)``: an uncorrelated sub-select, which PostgreSQL
    evaluates once, before the delete reads a row (an InitPlan), so a batch is exactly what
    it picked; as ``key IN (SELECT …)`` it could be planned as the inner side of a semi-join
    and rescanned (``locked_batch``). The delete finds the rows through the primary key
    (``key = ANY(array)``: an index scan probing each key). Only the count picked, the last
    key and the count deleted come back.
    """
    (key,) = target.key
    pick = select(key).where(*target.settled(cutoff)).order_by(key).limit(size)
    if after is not None:
        pick = pick.where(key > after[0])
    picked = (select(func.array(pick.scalar_subquery(), type_=ARRAY(key.type)).label("ids"))
              .cte("picked").prefix_with("MATERIALIZED"))
    # The cast makes ANY take the array as a value: "ANY (SELECT …)" compares with each row.
    keys = cast(select(picked.c.ids).scalar_subquery(), ARRAY(key.type))
    gone = delete(target.table).where(key == any_(keys), *target.settled(cutoff)).returning(key).cte("gone")
    count = func.cardinality(picked.c.ids)
    return select(count, picked.c.ids[count], select(func.count()).select_from(gone).scalar_subquery())


def locked_batch(engine: Engine, target: Target, cutoff: datetime, size: int,
                 after: Sequence[Any] | None) -> Batch:
    """Pick the batch's keys ``FOR UPDATE SKIP LOCKED``, then delete those rows through their key.

    The pick is its own statement so that a batch is exactly what it picked. As one
    ``DELETE … WHERE key IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)`` the database was
    free to plan the pick as the inner side of a semi-join: rescanned, it skipped the rows the
    statement had deleted already and picked n more, so one "batch" deleted every settled
    row in one transaction; planned as a hash join instead, each batch read the whole table.
    The delete takes the keys as one array per column (``_pg_arrays``): a constant text,
    and a plan that probes the primary key once per row.
    """
    pick = (select(*target.key).where(*target.settled(cutoff)).order_by(*target.key).limit(size)
            .with_for_update(skip_locked=True))
    if after is not None:
        pick = pick.where(key_of(target) > values_of(target, after))
    columns = {c.name: c.type for c in target.key}
    picked = rows_of(columns, name="picked")
    with engine.begin() as conn:
        rows = conn.execute(pick).all()
        if not rows:
            return 0, None, 0
        # The picked range bounds the index scan: a merge join over the whole key order
        # would walk every row deleted by the batches before (dead until vacuumed).
        gone = delete(target.table).where(
            *[c == picked.c[c.name] for c in target.key], *target.settled(cutoff),
            key_of(target) >= values_of(target, rows[0]), key_of(target) <= values_of(target, rows[-1]))
        deleted = conn.execute(gone, array_params(columns, {
            c.name: [row[n] for row in rows] for n, c in enumerate(target.key)})).rowcount
    return len(rows), tuple(rows[-1]), deleted


def key_of(target: Target) -> Any:
    return target.key[0] if len(target.key) == 1 else tuple_(*target.key)


def values_of(target: Target, row: Sequence[Any]) -> Any:
    """A key's values, bound with their columns' types (a UUID is text on MySQL)."""
    if len(row) == 1:
        return row[0]
    return tuple_(*[literal(value, column.type) for value, column in zip(row, target.key, strict=True)])
