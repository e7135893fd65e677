"""What ``publish()`` says in PostgreSQL's NOTIFY: the shard, and the schema the row went to.

One listening connection per database serves every tenant schema in it, so the
payload names the schema: ``"<shard>"`` when the row was written to the
outbox's tables without a schema (the connection's default, ``search_path``),
else ``"<shard>:<schema>"``, the schema after the connection's
``schema_translate_map`` (the schema the row was really written to). Schema
names are plain identifiers (``validate_identifier``), so they hold no ``:``:
a reader splits on the first one. A relay that serves one schema ignores the
payload; a multi-tenant relay reads it with ``parse_notify_payload``.
"""

from __future__ import annotations


def notify_payload(shard: int, schema: str | None) -> str:
    """The payload of a row of ``shard`` written to ``schema`` (``None``: no schema)."""
    return str(shard) if schema is None else f"{shard}:{schema}"


def parse_notify_payload(payload: str) -> tuple[int, str | None]:
    """(shard, schema) from a payload ``notify_payload`` made; ``ValueError`` for another text.

    Another process may NOTIFY on the same channel: what it says is refused here,
    never taken for a shard.
    """
    shard_text, colon, schema = payload.partition(":")
    if not shard_text.isascii() or not shard_text.isdigit() or (colon and not schema):
        raise ValueError(f"not an outbox notification payload: {payload[:80]!r}")
    return int(shard_text), (schema if colon else None)
