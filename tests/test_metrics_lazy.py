"""Metrics are registered by the parts a process uses, not by ``import outbox``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sqlalchemy as sa
    from prometheus_client import REGISTRY
    import outbox

    def names():
        return sorted(n for n in REGISTRY._names_to_collectors if n.startswith("outbox_"))

    engine = sa.create_engine("sqlite://")
    ob = outbox.Outbox(engine)
    ob.create_tables()
    with engine.begin() as conn, sa.orm.Session(bind=conn) as session:
        ob.publish(session, "orders", {"id": 1}, key="o-1")
    producer = names()
    first = outbox.Inbox(engine, group="billing")
    outbox.Inbox(engine, group="audit")  # a second Inbox registers nothing twice
    print(json.dumps({"producer": producer, "inbox": names()}))
""")


def test_import_and_publish_register_no_inbox_metric_and_an_inbox_registers_them_once():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(result.stdout.splitlines()[-1])
    assert not [n for n in seen["producer"] if n.startswith("outbox_inbox_")], seen["producer"]
    inbox = {n for n in seen["inbox"] if n.startswith("outbox_inbox_")}
    assert {"outbox_inbox_consumed", "outbox_inbox_parked_keys", "outbox_inbox_commit_lag",
            "outbox_inbox_handler_seconds"} <= inbox
