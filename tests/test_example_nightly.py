"""The scheduled audit/archive example gates on findings and archives past retention."""

from __future__ import annotations

from datetime import timedelta

import _spark_seed as seed
import pytest
import sqlalchemy as sa

from examples.nightly_audit_archive import nightly

pytestmark = pytest.mark.spark


def test_nightly_job_fails_on_loss_then_archives(java_home, tmp_path):
    outbox_db, inbox_db = f"sqlite:///{tmp_path}/outbox.db", f"sqlite:///{tmp_path}/inbox.db"
    scenario = seed.build(n=3000, keys=20)
    seed.seed(scenario, outbox_db, inbox_db)
    published = sum(1 for i in range(scenario.n)
                    if i not in scenario.pending and i not in scenario.failed)

    # The day of the traffic: the seeded losses are found, nothing is old enough to archive.
    assert nightly(outbox_db, inbox_db, tmp_path / "archive", tmp_path / "day0",
                   as_of=seed.AS_OF) == 1
    with sa.create_engine(outbox_db).connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM outbox_messages")) == scenario.n

    # Eight days later: the window is quiet, and every published row moves to the archive.
    assert nightly(outbox_db, inbox_db, tmp_path / "archive", tmp_path / "day8",
                   as_of=seed.AS_OF + timedelta(days=8)) == 0
    with sa.create_engine(outbox_db).connect() as conn:
        left = dict(conn.execute(sa.text(
            "SELECT status, count(*) FROM outbox_messages GROUP BY status")).all())
    assert "published" not in left
    assert sum(left.values()) == scenario.n - published
    assert list((tmp_path / "archive").rglob("*.parquet"))
