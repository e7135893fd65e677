"""Checks applied to every message before it reaches the database.

Each check raises the specific ``MessageValidationError`` subclass and names the
offending value, so the caller learns what is wrong inside ``publish()``, before
anything commits, instead of the relay finding a poison row later.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

# Topic names are checked where transports check them too (the lowest layer).
from transports._errors import validate_topic as validate_topic

from ._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidHeadersError,
    InvalidKeyError,
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")

MAX_KEY_LENGTH = 255
# A MIME type as a header value: visible ASCII, inner spaces allowed ("text/csv; charset=utf-8").
_CONTENT_TYPE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,98}[\x21-\x7e])?")
RESERVED_HEADER_PREFIX = "outbox-"



def normalize_key(key: object) -> str | None:
    """Return the key as text; str, int and UUID keys are accepted."""
    if key is None:
        return None
    if isinstance(key, bool) or not isinstance(key, str | int | uuid.UUID):
        raise InvalidKeyError(
            f"key must be str, int or UUID, got {type(key).__name__}: {key!r}"
        )
    text = str(key)
    if not text:
        raise InvalidKeyError("key must not be empty; pass key=None for unkeyed messages")
    if "\x00" in text:
        raise InvalidKeyError(f"key must not contain NUL characters: {text[:40]!r}")
    if len(text) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"key is {len(text)} characters, the maximum is {MAX_KEY_LENGTH}: {text[:40]!r}..."
        )
    return text


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


def validate_headers(headers: Mapping[str, Any] | None) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidHeadersError(f"headers must be a mapping, got {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidHeadersError(f"header names must be non-empty str, got {name!r}")
        if name.lower().startswith(RESERVED_HEADER_PREFIX) or name.lower() == "content-type":
            raise InvalidHeadersError(f"header {name!r} is reserved for the outbox envelope")
        if not isinstance(value, str):
            raise InvalidHeadersError(
                f"header {name!r} must be a str, got {type(value).__name__}: {value!r}"
            )
    return dict(headers)


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
