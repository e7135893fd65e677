"""What an inbox serving tenants is told (``Inbox(tenants=…)``, ``serve_tenants``): checked once.

Every setting is refused by name when the inbox is built, before a message
arrives: a tenant header that is no header name or that the envelope reads
itself, a ``tenant_of`` that is no function, both or neither of the two, a
refresh that is no positive number of seconds, an async inbox (a tenant's
pipeline is built on a sync engine).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from ..core._envelope import Message
from ..core._errors import ConfigurationError
from ..core._validation import folded
from ..core._wire import ENVELOPE_HEADERS


def checked_refresh(header: str | None, tenant_of: Callable[[Message], str | None] | None,
                    refresh: timedelta | float, *, is_async: bool) -> float:
    """Refuse settings an inbox cannot serve its tenants with; the seconds between reads of them.

    The tenants themselves are the caller's to check first (``None``: no tenants to serve).
    """
    if (header is None) == (tenant_of is None):
        raise ConfigurationError("an inbox serving tenants needs one of tenant_header= (the header "
                                 "naming the tenant) or tenant_of= (a function of the message)")
    if header is not None and (not isinstance(header, str) or not header.strip()
                               or header != header.strip()
                               or not header.isprintable() or len(header) > 200):
        raise ConfigurationError(f"tenant_header must be a header name, got {header!r:.80}")
    if header is not None and folded(header) in ENVELOPE_HEADERS:  # in any case: read into the envelope
        raise ConfigurationError(f"tenant_header {header!r} is an outbox envelope header: name "
                                 "the header that carries the tenant (e.g. 'x-tenant')")
    if tenant_of is not None and not callable(tenant_of):
        raise ConfigurationError(f"tenant_of must be a function of the message, got {tenant_of!r:.80}")
    if is_async:
        raise ConfigurationError("tenants= needs an Inbox built on a sync Engine or sessionmaker")
    seconds = refresh.total_seconds() if isinstance(refresh, timedelta) else refresh
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigurationError(f"tenant_refresh must be a positive number of seconds, got {refresh!r}")
    return float(seconds)
