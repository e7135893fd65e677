"""Whatever a stored row holds, the relay's encoder gives a record the inbox decodes unchanged,
or refuses that row alone with a storable reason: never an exception that would fail the batch."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import record_to_message
from outbox.relay._rows import RowEncoder

# Every code point, lone surrogates and NUL included (st.text() leaves surrogates out).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
NAMES = st.one_of(ANY_TEXT, st.sampled_from(["h", "traceparent", "outbox-seq", "Content-Type", ""]))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
    max_leaves=6,
)
HEADERS = st.one_of(
    st.dictionaries(NAMES, ANY_TEXT, max_size=4).map(json.dumps),  # mostly well-formed
    JSON_VALUES.map(json.dumps),
    ANY_TEXT,  # any text at all, JSON or not
    st.sampled_from([None, "{}", "null"]),
)
NOW = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


@st.composite
def rows(draw: st.DrawFn) -> tuple[Any, ...]:
    key = draw(st.none() | ANY_TEXT | st.sampled_from(["k", "k" * 255, "k" * 256]))
    seq = draw(st.none() | st.integers(min_value=-1, max_value=2**64)) if draw(st.booleans()) else 1
    topic = draw(st.sampled_from(["orders", "a.b_c-1", "t" * 249, "t" * 250, ".", ""]) | ANY_TEXT)
    content_type = draw(st.sampled_from(["application/json", "text/csv; charset=utf-8"]) | ANY_TEXT)
    payload = draw(st.binary(max_size=8) | st.sampled_from(["text", 5, None]))
    event_type = draw(st.none() | st.sampled_from(["OrderPaid", "t" * 255, "t" * 256, "", 5]) | ANY_TEXT)
    return (1, str(uuid.uuid4()), topic, key, seq, 0, payload, content_type, draw(HEADERS), NOW,
            NOW, 0, event_type)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows(), min_size=1, max_size=3))
def test_any_row_becomes_an_intact_record_or_fails_alone_with_a_storable_reason(
    batch: list[tuple[Any, ...]]
) -> None:
    records, sent, unsendable = RowEncoder().records(batch)
    assert len(records) == len(sent)
    assert len(sent) + len(unsendable) <= len(batch)
    for _, reason in unsendable:
        assert reason.startswith("cannot be sent: ") and "\x00" not in reason
        reason.encode()  # storable in every database's text column
    sent_ids, failed_ids = {row[1] for row in sent}, {row[1] for row, _ in unsendable}
    stopped = set()
    for row in batch:  # in batch order: nothing of a key goes out after its failed row
        if row[3] is not None and (row[2], row[3]) in stopped:
            assert row[1] not in sent_ids and row[1] not in failed_ids
        elif row[1] in failed_ids and row[3] is not None:
            stopped.add((row[2], row[3]))
        elif row[1] not in failed_ids:
            assert row[1] in sent_ids
    for record, row in zip(records, sent, strict=True):
        for name, _ in record.headers:
            name.encode()  # the producer encodes header names itself
        message = record_to_message(record)  # what the inbox does: no broken envelope
        stored = row[8]
        user = {} if stored in (None, "{}", "null") else json.loads(stored)
        assert (message.topic, message.key, message.payload, message.content_type, message.headers) \
            == (row[2], row[3], row[6], row[7], user)
        assert message.seq == row[4] and message.created_at == NOW
        assert message.event_type == row[12]


def test_a_message_id_that_is_no_uuid_fails_its_row_where_the_database_stores_text() -> None:
    """MySQL/MariaDB keep the id as CHAR(32), dashed by the fetch whatever it holds."""
    row = (1, "zzzzzzzz-zzzz-zzzz-zzzz-zzzzzzzzzzzz", "orders", "k", 1, 0, b"{}", "application/json",
           None, NOW, NOW, 0, None)
    good = (2, str(uuid.uuid4()), "orders", "j", 1, 0, b"{}", "application/json", None, NOW, NOW, 0, None)
    records, sent, unsendable = RowEncoder(check_ids=True).records([row, good])
    assert [r[0] for r in sent] == [2] and len(records) == 1
    assert [(r[0], "is not a UUID" in reason) for r, reason in unsendable] == [(1, True)]
