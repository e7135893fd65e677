"""Statuses, outcomes, alert kinds and policies are enums, and their stored and JSON strings did not change.

No server: a value stored in a table or sent as JSON is a contract with
every older row and every alert receiver, so the strings are pinned here.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from outbox import Alert, AlertKind, ConfigurationError, ForeignRecords, Inbox
from outbox.core._tables import InboxOutcome, OutboxStatus
from outbox.inbox import InboxOutcome as PublicInboxOutcome
from outbox.spark._findings import Seen


def test_the_stored_and_sent_strings_are_the_old_ones() -> None:
    assert [s.value for s in OutboxStatus] == ["pending", "published", "failed", "skipped"]
    assert [o.value for o in InboxOutcome] == ["processed", "skipped", "discarded"]
    assert PublicInboxOutcome is InboxOutcome  # one definition, with the tables, exported by the inbox
    assert [k.value for k in AlertKind] == [
        "message_failed", "key_stuck", "key_parked", "message_parked", "foreign_record", "gap_held"]
    assert [f.value for f in ForeignRecords] == ["park", "accept"]
    assert [s.value for s in Seen] == ["inbox", "parked", "held"]


@given(kind=st.sampled_from(AlertKind), as_text=st.booleans())
def test_an_alert_kind_is_an_enum_member_and_its_json_the_same_string(kind: AlertKind, as_text: bool) -> None:
    alert = Alert(kind=kind.value if as_text else kind, topic="t", key=None, message_id=None, error="e")
    assert alert.kind is kind
    assert json.loads(json.dumps(alert.to_json()))["kind"] == kind.value
    assert f"{alert.kind}" == kind.value  # what the log line shows


@given(text=st.text(max_size=30).filter(lambda t: t not in {k.value for k in AlertKind}))
def test_an_unknown_alert_kind_is_refused_with_the_known_ones(text: str) -> None:
    with pytest.raises(ConfigurationError, match="Alert kind must be one of message_failed, key_stuck"):
        Alert(kind=text, topic="t", key=None, message_id=None, error="e")


@pytest.mark.parametrize("policy", [ForeignRecords.ACCEPT, "accept"])
def test_foreign_records_takes_the_enum_or_its_old_string(sqlite_db: str, policy: str) -> None:
    box = Inbox(sa.create_engine(sqlite_db), group="g", foreign_records=policy)
    assert box.foreign is ForeignRecords.ACCEPT
    with pytest.raises(ConfigurationError,
                       match="foreign_records must be 'park', 'accept', 'debezium' or a ForeignEnvelope"):
        Inbox(sa.create_engine(sqlite_db), group="g", foreign_records="drop")
