"""Which storage a database gets: chosen once, by the engine's dialect name."""

from __future__ import annotations

from ...core._errors import ConfigurationError
from ...core._tables import MYSQL_FAMILY
from ._mysql import mysql_storage
from ._pg import postgres_storage
from ._sqlite import sqlite_storage
from ._storage import StorageFactory

STORAGES: dict[str, StorageFactory] = {
    "sqlite": sqlite_storage,
    "postgresql": postgres_storage,
    **dict.fromkeys(MYSQL_FAMILY, mysql_storage),
}


def storage_for(dialect: str) -> StorageFactory:
    """The storage factory of ``dialect`` (an engine's ``dialect.name``)."""
    try:
        return STORAGES[dialect]
    except KeyError:
        raise ConfigurationError(f"unsupported database dialect {dialect!r}; "
                                 f"supported: {tuple(STORAGES)}") from None
