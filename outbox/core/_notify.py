"""What ``publish()`` says in PostgreSQL's NOTIFY: the shard, and the schema the row went to.

One listening connection per database serves every tenant schema in it, so the
payload names the schema: ``"<shard>:<schema>"``, the schema after the
connection's ``schema_translate_map`` (the schema the row was really written
to), or, for a row written without a schema, the server's ``current_schema()``
(``notified``): the schema as the server names it, never as a writer spelled
it, so a writer naming ``public`` and one relying on ``search_path`` say the
same. (``"<shard>"`` alone, from writers before that, means "no schema".)
Schema names are plain identifiers (``validate_identifier``), so they hold no
``:``: a reader splits on the first one. A relay that serves one schema ignores
the payload; a multi-tenant relay reads it with ``parse_notify_payload``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Text, case, func, literal


def notify_payload(shard: int, schema: str | None) -> str:
    """The payload of a row of ``shard`` written to ``schema`` (``None``: no schema)."""
    return str(shard) if schema is None else f"{shard}:{schema}"


def notified(channel: str, payload: Any) -> Any:
    """``pg_notify(channel, payload)``, a payload without a schema completed with ``current_schema()``.

    ``payload`` is a SQL expression of ``notify_payload``'s text (a bound parameter).
    """
    named = case((func.strpos(payload, ":") > 0, payload),
                 else_=func.concat(payload, ":", func.current_schema()))
    return func.pg_notify(literal(channel), named.cast(Text))


def parse_notify_payload(payload: str) -> tuple[int, str | None]:
    """(shard, schema) from a payload ``notify_payload`` made; ``ValueError`` for another text.

    Another process may NOTIFY on the same channel: what it says is refused here,
    never taken for a shard.
    """
    shard_text, colon, schema = payload.partition(":")
    if not shard_text.isascii() or not shard_text.isdigit() or (colon and not schema):
        raise ValueError(f"not an outbox notification payload: {payload[:80]!r}")
    return int(shard_text), (schema if colon else None)
