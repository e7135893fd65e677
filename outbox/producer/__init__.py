"""The producer: ``Outbox`` and ``AsyncOutbox`` write events in the caller's transaction.

Private modules behind the names ``outbox`` exports: ``_outbox`` (``Outbox``,
sync), ``_async_outbox`` (``AsyncOutbox``), ``_outbox_base`` (what both
flavours share: checks, rows, the NOTIFY), ``_statements`` (the SQL behind
``publish()``, one set per dialect) and ``_transactional`` (the decorator's
wrappers). The producer stands on ``outbox.core``; the relay reads what it
writes and is configured by an ``Outbox``.
"""

from ._async_outbox import AsyncOutbox
from ._outbox import Outbox

__all__ = ["AsyncOutbox", "Outbox"]
