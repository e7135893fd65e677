"""A fetched outbox row as a broker record, or the reason it can never be one.

``publish()`` refuses what the relay cannot send, but a row may also come from an
older release, from hand-written SQL or from a bug. Such a row must not stop the
relay: an exception out of encoding one row would fail the whole batch, every
batch, for every key. So each row is encoded on its own, and one that breaks
the envelope's contract raises ``UnsendableRow`` naming the field; the batch
then marks that row failed alone (its key waits, one alert) and sends the rest.

The contract checked here is what the other end needs: what the producer can
encode (UTF-8 text without lone surrogates, a topic Kafka accepts) and what
``record_to_message`` decodes without calling the record broken (a key of 1-255
characters without NUL and a seq of 1..2^63-1, a content type of visible ASCII,
user headers that are a JSON object of text, none named like the envelope).
A row the broker refuses (too large for ``message.max.bytes``) fails through
the transport's own per-record result; a broker that does not answer is an
outage, retried, never a row's failure.

This runs per row on the relay's hot path: the checks that every row needs are
a set lookup or a length test; headers are decoded only when not empty; the
slow diagnosis runs only for a row that failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from transports import Record
from transports._errors import InvalidTopicError, validate_topic

from ..core._cloudevents import RELAY_ATTRIBUTES, CloudEvents, cloudevent_headers
from ..core._errors import MessageValidationError
from ..core._validation import (
    MAX_KEY_LENGTH,
    RESERVED_HEADER_PREFIX,
    checked_event_type,
    folded,
    validate_content_type,
)
from ..core._wire import CONTENT_TYPE, MAX_SEQ, to_record
from ._sql import ROW_COLUMNS

_NO_HEADERS = frozenset({None, "{}", "null"})
_UUID_TEXT = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_TOPIC, _KEY = ROW_COLUMNS.index("topic"), ROW_COLUMNS.index("key")
_ID, _SEQ, _CREATED_AT = (ROW_COLUMNS.index(name) for name in ("message_id", "seq", "created_at"))
_MAX_REASON = 500
_MAX_SEEN = 10_000


class UnsendableRow(ValueError):
    """The row can never become a valid record as it is stored; ``str()`` says why."""


class RowEncoder:
    """Encodes fetched rows (``_sql.ROW_COLUMNS`` order) into records; one per relay thread."""

    __slots__ = ("_check_ids", "_cloudevents_source", "_content_types", "_event_types", "_incarnation",
                 "_topics")

    def __init__(self, incarnation: str | None = None, *, check_ids: bool = False,
                 cloudevents: CloudEvents | None = None) -> None:
        self._incarnation = incarnation
        # CloudEvents binary mode: its ce_source, or None when off.
        self._cloudevents_source = cloudevents.source_for(incarnation) if cloudevents else None
        # MySQL/MariaDB store the message id as 32 characters of CHAR, dashed into its
        # text by the fetch whatever they are: there only, a row can carry an id that
        # is no UUID (PostgreSQL's uuid type and SQLite's read both refuse one).
        self._check_ids = check_ids
        # Topics and content types seen valid: a relay meets a handful, so each regex
        # runs once per value.
        self._topics: set[str] = set()
        self._content_types: set[str] = set()
        self._event_types: set[str] = set()

    def records(self, rows: Sequence[Any]) -> tuple[list[Record], Sequence[Any], list[tuple[Any, str]]]:
        """Records of ``rows``, the rows they are of, and the unsendable rows with their reason.

        After an unsendable row of a key, that key's later rows are left out of both
        lists: they stay pending behind it, as behind a failed head.
        """
        records: list[Record] = []
        unsendable: list[tuple[Any, str]] = []
        encoded: list[Any] = []
        stopped: set[tuple[Any, Any]] = set()
        encode = self._record
        for row in rows:
            if stopped and row[_KEY] is not None and (row[_TOPIC], row[_KEY]) in stopped:
                continue
            try:
                records.append(encode(row))
            except Exception as exc:  # to_record's encode(), or a value of an unexpected type
                reason = str(exc) if isinstance(exc, UnsendableRow) else _diagnose(row, exc)
                unsendable.append((row, safe_reason(f"cannot be sent: {reason}")))
                if row[_KEY] is not None:
                    stopped.add((row[_TOPIC], row[_KEY]))
                continue
            encoded.append(row)
        return records, (encoded if unsendable else rows), unsendable

    def _record(self, row: Any) -> Record:
        """The row's record; raises ``UnsendableRow``, or what encoding raised, if it cannot be one."""
        (_, message_id, topic, key, seq, _, payload, content_type, headers, created_at,
         available_at, _, event_type, *_) = row  # then the batch's bytes so far (``ROW_OCTETS``)
        if self._check_ids and (type(message_id) is not str or not _UUID_TEXT.fullmatch(message_id)):
            raise UnsendableRow(f"message id {_short(message_id)} is not a UUID: the inbox "
                                "could not read the envelope")
        if topic not in self._topics:
            _remember(self._topics, topic, validate_topic)
        if key is not None:
            if type(key) is not str or not 0 < len(key) <= MAX_KEY_LENGTH or "\x00" in key:
                raise UnsendableRow(_key_problem(key))
            if seq is None:
                raise UnsendableRow("keyed row has seq None: a key's rows are numbered from 1")
        if seq is not None and (type(seq) is not int or not 1 <= seq <= MAX_SEQ):
            raise UnsendableRow(f"row has seq {seq!r}, outside 1..{MAX_SEQ}")
        if type(payload) is not bytes:
            raise UnsendableRow(f"payload is {type(payload).__name__}, not bytes")
        if content_type not in self._content_types:
            _remember(self._content_types, content_type, validate_content_type)
        if event_type is not None and event_type not in self._event_types:
            _remember(self._event_types, event_type, _event_type)
        record = to_record(
            message_id=message_id, topic=topic, key=key, seq=seq, payload=payload,
            content_type=content_type,
            headers=None if headers in _NO_HEADERS else user_headers(headers),
            created_at=created_at, available_at=available_at, incarnation=self._incarnation,
            event_type=event_type,
        )
        if self._cloudevents_source is not None:
            self._add_cloudevent(record, row, event_type)
        return record

    def _add_cloudevent(self, record: Record, row: Any, event_type: str | None) -> None:
        """Add the ``ce_*`` attributes; a user header of the same name gives way to them."""
        try:
            attributes = cloudevent_headers(
                source=self._cloudevents_source or "", message_id=row[_ID], topic=row[_TOPIC],
                event_type=event_type, created_at=row[_CREATED_AT], seq=row[_SEQ],
                incarnation=self._incarnation)
        except ValueError as exc:
            raise UnsendableRow(str(exc)) from None
        if any(folded(name) in RELAY_ATTRIBUTES for name, _ in record.headers):
            record.headers = [(name, value) for name, value in record.headers
                              if folded(name) not in RELAY_ATTRIBUTES]
        record.headers.extend(attributes)


def _event_type(value: object) -> str:
    """A row's event type as the inbox will decode it (raw SQL may have written any text)."""
    return checked_event_type(value)[0]


def _remember(seen: set[str], value: object, validate: Callable[[object], str]) -> None:
    """Validate ``value`` (``UnsendableRow`` if invalid) and add it to ``seen``, a bounded set."""
    try:
        valid = validate(value)
    except (MessageValidationError, InvalidTopicError) as exc:
        raise UnsendableRow(str(exc)) from None
    if len(seen) >= _MAX_SEEN:
        seen.clear()
    seen.add(valid)


def user_headers(text: object) -> dict[str, str]:
    """The stored headers JSON as the user's headers; ``UnsendableRow`` names what is wrong."""
    if not isinstance(text, str):
        raise UnsendableRow(f"headers are {type(text).__name__}, not JSON text")
    try:
        headers = json.loads(text)
    except ValueError as exc:
        raise UnsendableRow(f"headers are not valid JSON: {exc}") from None
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise UnsendableRow(f"headers must be a JSON object of text, got a {type(headers).__name__}")
    for name, value in headers.items():
        if not name or "\x00" in name:
            raise UnsendableRow(f"header name {name!r} is empty or has a NUL")
        lowered = name.lower()
        if lowered.startswith(RESERVED_HEADER_PREFIX) or lowered == CONTENT_TYPE:
            raise UnsendableRow(f"header {name!r} is reserved for the outbox envelope")
        if not isinstance(value, str):
            raise UnsendableRow(f"header {name!r} must be text, got {type(value).__name__}: "
                                f"{_short(value)}")
        # The producer encodes names itself (an error there would fail the batch); values
        # are encoded by to_record, and _diagnose names the one that failed.
        if problem := _text_problem(name):
            raise UnsendableRow(f"header name is {problem}")
    return headers


def _key_problem(key: object) -> str:
    if not isinstance(key, str):
        return f"key is {type(key).__name__}, not text"
    return f"key must be 1-{MAX_KEY_LENGTH} characters without NUL, got {len(key)}: {_short(key)}"


def _text_problem(text: str) -> str | None:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 text ({exc.reason} at {exc.start}): {_short(text)}"
    return None


def _diagnose(row: Any, exc: Exception) -> str:
    """Name the field that made encoding fail (the slow path, for a failed row only)."""
    key, headers = row[_KEY], row[ROW_COLUMNS.index("headers")]
    if isinstance(key, str) and (problem := _text_problem(key)):
        return f"key is {problem}"
    if isinstance(headers, str) and headers not in _NO_HEADERS:
        for name, value in user_headers(headers).items():
            if problem := _text_problem(value):
                return f"header {name!r} is {problem}"
    return f"row cannot be encoded: {type(exc).__name__}: {exc}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def safe_reason(reason: str) -> str:
    """``reason`` as text every database stores: no lone surrogate, no NUL, bounded."""
    text = reason.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")
    return text if len(text) <= _MAX_REASON else text[:_MAX_REASON - 3] + "..."
