"""The status of an outbox row: its values, and the column type that puts them in SQL as constants."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy import String, TypeDecorator, literal_column


class OutboxStatus(StrEnum):
    """Where an outbox row is; a ``str`` enum, so the stored values are these strings."""

    PENDING = "pending"
    """Committed, not yet acknowledged by the broker (maybe waiting for a delay or retry)."""
    PUBLISHED = "published"
    """Acknowledged by the broker; ``kafka_partition``/``kafka_offset`` say where."""
    FAILED = "failed"
    """Can never be sent as it is; blocks its key until an operator retries or skips it."""
    SKIPPED = "skipped"
    """A failed row an operator chose not to send (``outbox failed skip``)."""



class StatusText(TypeDecorator[str]):
    """``outbox_messages.status``: a ``VARCHAR(9)`` whose comparisons with an ``OutboxStatus``
    are constants in the SQL text, never bound parameters.

    The partial indexes (``ix_outbox_pending``, ``ix_outbox_open_key``,
    ``ix_outbox_key_waits``) serve a query only when the planner can prove the
    query's ``status`` terms imply the index's predicate, and PostgreSQL proves
    that from constants only. psycopg prepares a statement on the server once a
    connection has run it 5 times, and from then on PostgreSQL may switch to the
    statement's generic plan, made without the parameters' values: with
    ``status = $1`` that plan cannot use a partial index and walks the primary key
    through every published row, for every fetch, until the next ANALYZE
    replans it (issue 37: 7x slower relay rounds, PostgreSQL's CPU tenfold; see
    docs/operations.md, "Statistics and the relay's plans"). With ``status = 'pending'`` the
    generic plan is the custom one. ``SET status = …`` stays a parameter.
    """

    impl = String(9)
    cache_ok = True

    class comparator_factory(TypeDecorator.Comparator[str]):  # the name SQLAlchemy looks up
        def operate(self, op: Any, *other: Any, **kwargs: Any) -> Any:
            return super().operate(op, *(_as_constant(o) for o in other), **kwargs)


def _as_constant(operand: Any) -> Any:
    """An ``OutboxStatus`` (or a list of them, for IN) as SQL text; anything else as it is."""
    if isinstance(operand, OutboxStatus):
        return literal_column(f"'{operand.value}'", String(9))
    if isinstance(operand, list | tuple) and operand and all(isinstance(o, OutboxStatus) for o in operand):
        return [_as_constant(o) for o in operand]
    return operand
