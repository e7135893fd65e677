"""``Inbox(storage=…)``: the inbox writes through the storage it is given, its own and each tenant's.

The storage is four small stores (``outbox.inbox.storage``); these tests wrap
one of them and check that every path that should go through it does, and
that a storage built for something else is refused when the inbox is built.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Disposition, Inbox, OutboxTables, create_engine
from outbox.inbox.storage import DedupRecords, InboxStorage, storage_for
from outbox.tenants import Tenant
from tests.inbox_support import AlertLog, applied, apply_effect, business, dispose, record

TOPIC = "orders"


class CountingDedup:
    """Dedup records that count the claims they insert, then let the real store insert them."""

    def __init__(self, inner: DedupRecords, seen: list[tuple[str, uuid.UUID]], group: str) -> None:
        self.inner, self.seen, self.group = inner, seen, group

    def claim(self, session: Session, deliveries: Sequence[Any]) -> set[uuid.UUID]:
        self.seen.extend((self.group, d.message.message_id) for d in deliveries)
        return self.inner.claim(session, deliveries)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counting(seen: list[tuple[str, uuid.UUID]], tables_seen: list[OutboxTables] | None = None) -> Any:
    def build(tables: OutboxTables, group: str) -> InboxStorage:
        if tables_seen is not None:
            tables_seen.append(tables)
        own = storage_for("sqlite")(tables, group)
        return dataclasses.replace(own, dedup=CountingDedup(own.dedup, seen, group))
    return build


def test_an_inbox_claims_through_the_storage_it_is_given(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'inbox.db'}")
    seen: list[tuple[str, uuid.UUID]] = []
    inbox = Inbox(engine, group="g", alert=AlertLog(), storage=counting(seen))
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler(TOPIC)(apply_effect)
    mid = uuid.uuid4()
    assert inbox.handle(record(TOPIC, "k", 1, message_id=mid)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "k", 1, message_id=mid)) is Disposition.DUPLICATE
    assert seen == [("g", mid)]  # the duplicate was looked up (at the key's position), not claimed
    assert applied(engine) == [("k", 1)]
    dispose(inbox)
    engine.dispose()


def test_each_tenant_gets_the_storage_the_inbox_was_given_on_its_own_tables(tmp_path: Path) -> None:
    default = create_engine(f"sqlite:///{tmp_path / 'default.db'}")
    seen: list[tuple[str, uuid.UUID]] = []
    tables: list[OutboxTables] = []
    inbox = Inbox(default, group="g", alert=AlertLog(), storage=counting(seen, tables),
                  tenants=[Tenant("acme", database=f"sqlite:///{tmp_path / 'acme.db'}")],
                  tenant_header="x-tenant")
    inbox.create_tables()
    inbox.create_tables(tenant="acme")
    acme = create_engine(f"sqlite:///{tmp_path / 'acme.db'}")
    business.create_all(acme)
    inbox.handler(TOPIC)(apply_effect)
    r = record(TOPIC, "k", 1)
    r.headers.append(("x-tenant", b"acme"))
    assert inbox.handle(r) is Disposition.APPLIED
    assert len(tables) == 2 and tables[1].schema is None  # the default's, then acme's (unqualified)
    assert [group for group, _ in seen] == ["g"]
    assert applied(acme) == [("k", 1)]
    dispose(inbox)
    default.dispose()
    acme.dispose()


def test_a_storage_of_another_group_or_no_storage_at_all_is_refused_when_the_inbox_is_built(
        tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'inbox.db'}")
    sqlite = storage_for("sqlite")
    with pytest.raises(ConfigurationError, match="not an InboxStorage of group 'g'"):
        Inbox(engine, group="g", storage=lambda tables, group: sqlite(tables, "other"))
    with pytest.raises(ConfigurationError, match="storage must be a StorageFactory"):
        Inbox(engine, group="g", storage=sqlite(OutboxTables(), "g"))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unsupported database dialect 'oracle'"):
        storage_for("oracle")
    engine.dispose()


def test_every_store_of_every_dialect_is_the_protocol_it_stands_for() -> None:
    """Each dialect's stores implement every method of their protocol (mypy checks the signatures)."""
    from outbox.inbox import storage

    protocols = {"dedup": storage.DedupRecords, "keys": storage.KeyPositions,
                 "held": storage.HeldMessages, "parked": storage.ParkedMessages}
    for dialect in ("sqlite", "postgresql", "mysql", "mariadb"):
        built = storage_for(dialect)(OutboxTables(), "g")
        for field, protocol in protocols.items():
            wanted = {name for name in vars(protocol) if not name.startswith("_")}
            store = getattr(built, field)
            missing = sorted(name for name in wanted if not callable(getattr(store, name, None)))
            assert missing == [], f"{dialect} {field}: {missing}"
