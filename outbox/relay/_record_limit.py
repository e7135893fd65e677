"""The relay's producer must send every record ``publish()`` accepts: checked before it runs."""

from __future__ import annotations

from transports import Transport

from ..core._errors import ConfigurationError


def check_record_limit(transport: Transport, max_record_bytes: int) -> None:
    """Refuse a transport that could not send every record ``publish()`` accepts.

    Publishers accept records up to the limit stored with the tables; a producer
    configured for less would fail some of them for good, each blocking its key
    until an operator steps in. A transport that does not say its limit is trusted.
    """
    limit = getattr(transport, "max_record_bytes", None)
    if isinstance(limit, int):
        refuse_smaller_producer(limit, getattr(transport, "max_record_setting", "its maximum record size"),
                                max_record_bytes)


def refuse_smaller_producer(limit: int, setting: str, max_record_bytes: int) -> None:
    """``ConfigurationError`` when a producer's ``limit`` (from ``setting``) is under the stored one."""
    if limit < max_record_bytes:
        raise ConfigurationError(
            f"this relay's producer sends records of at most {limit} bytes ({setting}), but "
            f"publishers accept records up to max_record_bytes={max_record_bytes} (stored with the "
            f"tables): raise that setting to allow {max_record_bytes}, or lower the stored limit "
            f"with `outbox init-db --max-record-bytes {limit}`")
