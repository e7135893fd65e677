"""The inbox's storage: small stores by concern, each a protocol with one class per dialect.

``InboxStorage`` bundles the four stores of one consumer group and owns the
one way a message is parked (``park``, which composes them):

- ``DedupRecords`` (``inbox_messages``): the ids the group recorded;
- ``KeyPositions`` (``inbox_keys``): each key's position and parked flag;
- ``HeldMessages`` (``inbox_held``): messages waiting behind a gap;
- ``ParkedMessages`` (``inbox_parked``): messages waiting for an operator.

The SQL every dialect shares is in one base per store (``DedupTable``,
``KeysTable``, ``HeldTable``, ``ParkedTable``); what differs is one class per
dialect in ``_sqlite``, ``_pg`` and ``_mysql``, chosen once by
``storage_for(engine.dialect.name)``. ``Inbox(storage=…)`` takes a
``StorageFactory`` instead, e.g. one that wraps a store to count or fail its
calls (docs/consumer.md, "Storage"). The operators' read-only listings are
``outbox.inbox.admin``.
"""

from ._dedup import DedupRecords, DedupTable
from ._dialects import storage_for
from ._held import HeldMessages, HeldTable
from ._keys import KeyPositions, KeysTable, KeyState
from ._mysql import mysql_storage
from ._parked import ParkedMessages, ParkedRow, ParkedTable
from ._pg import postgres_storage
from ._sqlite import sqlite_storage
from ._storage import InboxStorage, StorageFactory

__all__ = [
    "DedupRecords",
    "DedupTable",
    "HeldMessages",
    "HeldTable",
    "InboxStorage",
    "KeyPositions",
    "KeyState",
    "KeysTable",
    "ParkedMessages",
    "ParkedRow",
    "ParkedTable",
    "StorageFactory",
    "mysql_storage",
    "postgres_storage",
    "sqlite_storage",
    "storage_for",
]
