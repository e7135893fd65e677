"""A notification wakes the tenant of the schema it names, whatever the spelling of that schema.

A tenant's schema is the schema the server keeps (docs/tenants.md, "same database, same
schema"): a tenant with no schema is its database's ``current_schema()``. The payload of a
commit's NOTIFY names the schema as the writer spelled it (``outbox.core._notify``): none
for a writer that relies on ``search_path``, ``public`` for a writer that names it. While an
idle tenant's polls are backed off (``_idle_polls``), a notification that woke nobody (found by an
attack) left the row for the next poll, up to 60 s later, where it used to be ``poll_interval``.
Now a writer without a schema names its ``current_schema()`` (``outbox.core._notify.notified``)
and the tenant without one is matched by the database's (``FleetDatabases._notified``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, pending, wait_for
from test_tenant_polls import Fetches, listening, publish, schema_outbox, start
from test_tenant_polls import running as running  # the fixture

from outbox import Outbox, create_engine
from outbox.tenants import Tenant


@pytest.mark.postgres
@pytest.mark.parametrize("case", ["tenant-default-writer-public", "tenant-schema-writer-search-path"])
def test_a_notified_row_of_the_tenants_schema_spelled_otherwise_goes_out_promptly(
        case: str, pg: sa.Engine, postgres_db: str, monkeypatch: pytest.MonkeyPatch,
        running: list[Running], request: pytest.FixtureRequest) -> None:
    fetches = Fetches(monkeypatch)
    if case == "tenant-default-writer-public":
        Outbox(pg, shards=4).create_tables()  # in public, the database's default schema
        tenants: list[Any] = [Tenant("plain")]  # no schema: current_schema(), i.e. public
        writer = Outbox(pg, schema="public", shards=4)  # its payload: "<shard>:public"
        name = "plain"
    else:
        schema_outbox(pg, "acme")
        tenants = [Tenant("acme", schema="acme")]
        by_path = create_engine(postgres_db, connect_args={"options": "-c search_path=acme"})
        request.addfinalizer(by_path.dispose)
        writer = Outbox(by_path, shards=4)  # no schema, search_path acme: its payload "<shard>"
        name = "acme"
    start(running, tenants, pg, poll_interval=0.25)
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    # Just after a poll whose gap was 4 s (3.5 s at least: the upper half of its 3-4 s with the
    # jitter, or the 8 s step's): the next one comes 8 s later, 6 s at least, so at least 5.5 s after
    # the publish, past the 5 s waited below (a loaded host's seconds included). Backing off to 8 s
    # gaps first proved nothing more and took 16-30 s.
    wait_for(lambda: fetches.backed_off(name, 3.5) and time.monotonic() - fetches.at[name][-1] < 0.5,
             60, "its polls 4 s apart, one just made")
    publish(writer, "k")  # with its notification, on the default channel
    wait_for(lambda: pending(writer) == 0, 5, "the notified row sent")
