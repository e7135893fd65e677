"""The overview's inbox groups over every database of one console, and which database a page is about.

A console reads an outbox database and any number of consumers' own inbox
databases (``create_app(inbox_databases=...)``). Each is numbered: 0 is the
outbox's, then the inbox databases in the order given. The overview lists the
groups of every one, naming the database (credentials masked); the parked and
held pages and their actions take ``?db=N`` (absent: 0, the links of earlier
releases) and read and act on that database only. A database that cannot be
read is one line on the overview; the others are still shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import inspect

from ..core._envelope import utcnow
from ..core._errors import SchemaError
from ..inbox.admin import stuck_by_group
from ..ops import Database
from ..ops._stuck import _age, stuck_reasons
from ._refused import Refused


def database_index(values: Mapping[str, Any], databases: list[Database]) -> int:
    """The ``db`` query field as an index into ``databases``; 0 when absent."""
    raw = str(values.get("db") or "0")
    # Bounded before ``int()``, which refuses more than 4300 digits with a ValueError (a 500).
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9 or int(raw) >= len(databases):
        raise Refused(400, f"db must name one of this console's databases (0 to {len(databases) - 1}), "
                           f"as the overview's links give it")
    return int(raw)


def inbox_groups(index: int, db: Database, stuck_after: float) -> tuple[list[dict[str, Any]], list[str]]:
    """The groups of one inbox database as the overview lists them, and why they are stuck.

    Raises ``SchemaError`` when it has no inbox tables: it was given as an inbox database.
    """
    t = db.tables
    with db.engine.connect() as conn:
        found = inspect(conn)
        if not all(found.has_table(x.name, schema=t.schema) for x in (t.inbox_parked, t.inbox_held)):
            where = f"prefix {t.prefix!r}" + (f", schema {t.schema!r}" if t.schema else "")
            raise SchemaError(f"no inbox tables ({where}): check the console's --prefix/--schema, or "
                              f"run `outbox init-db` on it")
        now = utcnow()
        groups = [{"db": index, "database": db.name, "group": g.group, "parked_keys": g.parked_keys,
                   "parked_messages": g.parked_messages,
                   "oldest_parked_age_s": _age(now, g.oldest_parked), "held_messages": g.held_messages,
                   "oldest_held_age_s": _age(now, g.oldest_held)}
                  for g in stuck_by_group(conn, t)]
    reasons = stuck_reasons({"stuck_after_s": stuck_after, "outbox": None, "inbox": {"groups": groups}})
    return groups, [f"{db.name}: {r}" for r in reasons]
