"""Checks applied to every message before it reaches the database.

Each check raises the specific ``MessageValidationError`` subclass and names the
offending value, so the caller learns what is wrong inside ``publish()``, before
anything commits, instead of the relay finding a poison row later.
"""

from __future__ import annotations

import re
import string
import uuid
from collections.abc import Callable, Mapping
from typing import Any

# Topic names are checked where transports check them too (the lowest layer).
from transports._errors import shown as shown
from transports._errors import validate_topic as validate_topic

from ._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidEventTypeError,
    InvalidHeadersError,
    InvalidKeyError,
    MessageValidationError,
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")

MAX_KEY_LENGTH = 255
# A MIME type as a header value: visible ASCII, inner spaces allowed ("text/csv; charset=utf-8").
_CONTENT_TYPE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,98}[\x21-\x7e])?")
RESERVED_HEADER_PREFIX = "outbox-"



def normalize_key(key: object) -> str | None:
    """Return the key as text; str, int and UUID keys are accepted."""
    return checked_key(key)[0]


def checked_key(key: object) -> tuple[str | None, int]:
    """The key as text and its size in UTF-8 bytes (0 for no key), or ``InvalidKeyError``."""
    if key is None:
        return None, 0
    if isinstance(key, bool) or not isinstance(key, str | int | uuid.UUID):
        raise InvalidKeyError(
            f"key must be str, int or UUID, got {type(key).__name__}: {shown(key)}"
        )
    if isinstance(key, int) and key.bit_length() > _KEY_INT_BITS:
        raise InvalidKeyError(f"key is an int of {key.bit_length()} bits, more than "
                              f"{MAX_KEY_LENGTH} digits: the maximum is {MAX_KEY_LENGTH} characters")
    text = key_text(key)
    if not text:
        raise InvalidKeyError("key must not be empty; pass key=None for unkeyed messages")
    if len(text) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"key is {len(text)} characters, the maximum is {MAX_KEY_LENGTH}: {shown(text)}"
        )
    if "\x00" in text:
        raise InvalidKeyError(f"key must not contain NUL characters: {shown(text)}")
    return text, utf8_size(text, InvalidKeyError, "key")


_KEY_INT_BITS = (10**MAX_KEY_LENGTH).bit_length()
"""An int with more bits has more digits than a key may have characters (Python refuses
to write an int of over 4,300 digits as text at all: a bare ``ValueError``)."""


def key_text(key: str | int | uuid.UUID) -> str:
    """The key as the text its value is: what a subclass's ``__str__`` says does not count.

    ``str(key)`` of a ``str``/``int`` enum member is ``"Color.RED"``, not the ``"red"``
    the member equals, and a subclass can make ``__str__`` return anything: the key
    that arrives (and orders, and shards) is the value the caller's key compares equal to.
    """
    if type(key) is str:
        return key
    if isinstance(key, str):
        return str.__str__(key)
    if isinstance(key, int):
        return int.__repr__(key)
    return uuid.UUID.__str__(key)


def listed_message_id(message_id: uuid.UUID | str) -> str:
    """A message id as ``outbox failed list`` and ``outbox parked list`` show it, for an audit line.

    A UUID in any spelling ``uuid.UUID`` takes (upper case, braces, ``urn:uuid:``, no
    hyphens) is one id, named by its canonical text, so a search of the audit log for
    the listed id finds every action on it. Anything else is kept as given: the action
    refuses it and says what is wrong with it.
    """
    if isinstance(message_id, uuid.UUID):
        return str(message_id)
    try:
        return str(uuid.UUID(str(message_id)))
    except ValueError:
        return str(message_id)


def exact_str(text: str) -> str:
    """``text`` as a plain ``str``: a subclass's own ``isascii``/``encode`` cannot hide what it holds."""
    return text if type(text) is str else str.__str__(text)


def utf8_size(text: str, error: type[MessageValidationError], what: str) -> int:
    """``len(text.encode())``, or ``error`` naming ``what`` when text has a lone surrogate.

    A lone surrogate (``"\\ud800"``, which ``json.loads`` hands any service that
    parses client JSON) has no UTF-8 form: no database column, broker header or
    consumer could ever receive it. ASCII, the common case, is counted without encoding.
    """
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at "
                    f"index {exc.start} has no UTF-8 form: {shown(text)}") from None


MAX_EVENT_TYPE_LENGTH = 255  # the ``event_type`` column (``Name(255)``)
# No control characters (C0, DEL, C1): a type is a name shown in logs, consoles and headers.
# No noncharacters (U+FDD0-U+FDEF, U+xFFFE and U+xFFFF of every plane): CloudEvents forbids
# them in a String attribute, and the type is sent as ``ce_type`` in CloudEvents mode.
_NONCHARACTERS = "\ufdd0-\ufdef" + "".join(
    chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
_EVENT_TYPE_FORBIDDEN = re.compile(f"[\x00-\x1f\x7f-\x9f{_NONCHARACTERS}]")
_VALID_EVENT_TYPES: dict[str, int] = {}


def checked_event_type(event_type: object) -> tuple[str, int]:
    """The event type and its size in UTF-8 bytes, or ``InvalidEventTypeError`` saying why.

    1-255 characters of Unicode text without control characters, noncharacters
    (U+FFFE …, which CloudEvents forbids in ``ce_type``) or lone surrogates, so
    the ``event_type`` column, the ``outbox-event-type`` header and every
    consumer hold it unchanged. A service has a handful of types:
    those seen are looked up, not checked again (a bounded cache).
    """
    if type(event_type) is str:
        known = _VALID_EVENT_TYPES.get(event_type)
        if known is not None:
            return event_type, known
    if not isinstance(event_type, str):
        raise InvalidEventTypeError(
            f"event_type must be a str, got {type(event_type).__name__}: {shown(event_type)}")
    if not 0 < len(event_type) <= MAX_EVENT_TYPE_LENGTH:
        raise InvalidEventTypeError(
            f"event_type must be 1-{MAX_EVENT_TYPE_LENGTH} characters, got {len(event_type)}: "
            f"{shown(event_type)}")
    if (bad := _EVENT_TYPE_FORBIDDEN.search(event_type)) is not None:
        kind = "control characters" if ord(bad.group()) <= 0x9F else "Unicode noncharacters"
        raise InvalidEventTypeError(
            f"event_type must not contain {kind} ({bad.group()!r} at index "
            f"{bad.start()}): {shown(event_type)}")
    size = utf8_size(event_type, InvalidEventTypeError, "event_type")
    text = str.__str__(event_type)
    if len(_VALID_EVENT_TYPES) < 1024:
        _VALID_EVENT_TYPES[text] = size
    return text, size


def validate_content_type(content_type: object) -> str:
    # Every consumed message is checked, and a service uses a handful of content types:
    # one set lookup instead of the regex (bounded, so odd senders cannot grow it).
    if type(content_type) is str and content_type in _VALID_CONTENT_TYPES:
        return content_type
    if not isinstance(content_type, str) or not _CONTENT_TYPE.fullmatch(content_type):
        raise InvalidContentTypeError(
            f"content_type must be 1-100 visible ASCII characters, a MIME type such as "
            f"'application/avro', got {content_type!r}"
        )
    if type(content_type) is str and len(_VALID_CONTENT_TYPES) < 64:
        _VALID_CONTENT_TYPES.add(content_type)
    return content_type


_VALID_CONTENT_TYPES: set[str] = set()


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def folded(name: str) -> str:
    """A header name as it is matched: in ASCII lower case (``ID`` is ``id``), as HTTP field names are.

    Not ``str.lower`` on every name: it makes the Kelvin sign ``\u212a`` a ``k``, so
    another header that only looks like ``kind`` or ``ce_partitionkey`` would be read
    as it. On an ASCII name the two agree, and ``lower`` is several times faster.
    """
    return name.lower() if name.isascii() else name.translate(_ASCII_LOWER)


def checked_headers(headers: Mapping[str, Any] | None) -> tuple[dict[str, str], list[tuple[int, int]]]:
    """The headers as a new dict and each one's (name, value) size in UTF-8 bytes, or ``InvalidHeadersError``.

    Names are non-empty text without NUL (librdkafka cuts a header name at its
    first NUL) and not reserved for the envelope; names and values are text with
    a UTF-8 form. Every other character, NUL and control characters in values
    included, is stored as a JSON escape and arrives as it was sent.
    """
    if headers is None or (not headers and isinstance(headers, Mapping)):
        return {}, []
    if not isinstance(headers, Mapping):
        raise InvalidHeadersError(f"headers must be a mapping, got {type(headers).__name__}")
    sizes = []
    checked: dict[str, str] = {}  # what was checked is what is stored, whatever the mapping does
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidHeadersError(f"header names must be non-empty str, got {shown(name)}")
        name = exact_str(name)
        if name.lower().startswith(RESERVED_HEADER_PREFIX) or name.lower() == "content-type":
            raise InvalidHeadersError(f"header {shown(name)} is reserved for the outbox envelope")
        if not isinstance(value, str):
            raise InvalidHeadersError(
                f"header {shown(name)} must be a str, got {type(value).__name__}: {shown(value)}"
            )
        value = exact_str(value)
        if "\x00" in name:
            raise InvalidHeadersError(
                f"header name {shown(name)} contains NUL: Kafka clients cut a header name there")
        checked[name] = value
        sizes.append((len(name) if name.isascii() else utf8_size(name, InvalidHeadersError, "header name"),
                      len(value) if value.isascii()
                      else utf8_size(value, InvalidHeadersError, f"header {shown(name)}")))
    return checked, sizes


def validate_identifier(value: str, what: str, *, allow_empty: bool = False) -> str:
    """Accept only plain SQL identifiers; they are used as table-name parts."""
    if allow_empty and value == "":
        return value
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigurationError(
            f"invalid {what} {value!r}: use letters, digits and '_' "
            "(not starting with a digit, at most 41 characters)"
        )
    return value


def record_key(raw: bytes | None, refused: Callable[[str], Exception]) -> str | None:
    """A received record's key as a message key: ``None`` stays ``None``; anything else must be
    1-``MAX_KEY_LENGTH`` characters of UTF-8 without NUL, as ``publish()`` demands, or
    ``refused(why)`` is raised (the reader's own error: a CloudEvent's, a foreign record's)."""
    if raw is None:
        return None
    try:
        key = raw.decode()
    except UnicodeDecodeError:
        raise refused("record key is not UTF-8 text") from None
    if not key or len(key) > MAX_KEY_LENGTH or "\x00" in key:
        raise refused(f"record key must be 1-{MAX_KEY_LENGTH} characters without NUL, "
                      f"got {len(key)} characters: {key[:40]!r}")
    return key

