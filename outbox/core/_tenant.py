"""``Tenant`` and where a fleet's tenants come from: a list, a query, a callable, a file.

A tenant is a name and where its tables live: a schema of a database, or a
database of its own (or both). The name is what people read: it labels log
lines, alerts, metrics and the tenant header the relay stamps on every record,
so it is short printable ASCII. The schema is checked like any table name.

A ``TenantSource`` is anything called with no argument that returns the
current tenants; a relay or an inbox calls it again every refresh, which is
how tenants are added and removed while they run. ``tenant_source`` turns the
usual forms into one: a list, a callable, ``schemas_like(...)`` (the schemas
of a database whose name matches a pattern), ``from_query(...)`` (a query of
the application's own tenant table) and ``from_file(...)`` (a JSON file).
``parse_tenants`` reads the command line's ``--tenants`` spelling of each.

On the shared floor: the relay, the inbox, alerts and metrics check and name
tenants with it; ``outbox.tenants`` re-exports it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from transports._logsafe import safe_logger

from ._errors import ConfigurationError
from ._secrets import database_url
from ._validation import validate_identifier

log = safe_logger("outbox.tenants")

MAX_TENANT_NAME = 63
_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,{MAX_TENANT_NAME - 1}}}")


def check_tenant_name(name: object) -> str:
    """A tenant name: 1 to 63 of ``A-Z a-z 0-9 _ . -``, not starting with ``.`` or ``-``.

    Narrow on purpose: the name goes into headers, metric labels, log lines and
    file names unescaped, so nothing in it may need escaping anywhere.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"invalid tenant name {name!r:.80}: use 1 to {MAX_TENANT_NAME} letters, digits, '_', '.' "
            "or '-', not starting with '.' or '-'")
    return name


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: ``name``, and where its tables are.

    ``database`` is a URL or an ``Engine`` (``None``: the fleet's default
    database); ``schema`` is the schema holding the tenant's outbox and inbox
    tables in it (``None``: the database's default, as with ``--schema``
    unset). Two tenants must differ in name and in where their tables are:
    two addresses spelled alike are refused here, two that their servers say
    are one schema by whoever serves them (``_schemas``).
    """

    name: str
    schema: str | None = None
    database: str | Engine | None = None

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        if self.schema is not None:
            validate_identifier(self.schema, "tenant schema")
        if self.database is not None and not isinstance(self.database, str | Engine):
            raise ConfigurationError(
                f"tenant {self.name}: database must be a URL or an Engine, "
                f"got {type(self.database).__name__}")

    def __repr__(self) -> str:  # never the database's password
        return f"Tenant(name={self.name!r}, schema={self.schema!r}, database={self.database_shown!r})"

    @property
    def database_shown(self) -> str | None:
        """The database as it may be logged: its URL with the credentials masked."""
        if self.database is None:
            return None
        url = self.database if isinstance(self.database, str) else self.database.url
        return database_url(str(url) if not isinstance(url, str) else url)

    @property
    def address(self) -> tuple[str | None, str | None]:
        """(database URL as written, schema): where the tenant says its tables are.

        Spelled alike, two addresses are one; spelled otherwise they may still be
        one (``localhost`` and ``127.0.0.1``): what decides is what the server
        says (``SchemaClaims``).
        """
        db = self.database
        return (None if db is None else db if isinstance(db, str) else db.url.render_as_string(), self.schema)


TenantSource = Callable[[], Sequence[Tenant]]
"""Returns the tenants as they are now; called again at every refresh."""

TenantsLike = Iterable["Tenant | str"] | Callable[[], Iterable["Tenant | str"]]


def tenant_source(tenants: TenantsLike) -> TenantSource:
    """One ``TenantSource`` from a list (tenants, or schema names) or a callable returning one.

    A plain string is a schema of the default database, named after it. The
    result checks every answer: names and places unique, or ``ConfigurationError``.
    """
    if callable(tenants):
        call = tenants
        return lambda: checked_tenants(call())
    if isinstance(tenants, str | bytes):
        raise ConfigurationError("tenants must be a list of tenants or schema names, not one string")
    fixed = checked_tenants(tenants)
    return lambda: fixed


MAX_SHARES = 1024
"""The most processes a fleet's tenants are shared among (``TenantShare``)."""
_SHARE = re.compile(r"([0-9]{1,4})/([0-9]{1,4})")


@dataclass(frozen=True, slots=True)
class TenantShare:
    """Share ``index`` of ``count`` (from 0): the tenants one of ``count`` relay processes serves.

    Several ``outbox relay --tenants`` processes given the same tenants and
    shares 0 to ``count - 1`` serve each tenant from one process: every
    tenant's shard leases and connections are in one process, where without
    shares every process takes a part of every tenant's shards (and connects
    to every tenant's database). A tenant's share is decided by its name alone
    (``share_of``): the same in every process, on every host and in every
    release, whatever the order or the other tenants of the source.

    A share is where a tenant is served, not a fence: two processes that both
    serve one tenant (shares given twice, or processes read different sources
    for a while) split its shards by their leases, as any two relays do; a
    tenant of a share no process serves is not served.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if type(self.count) is not int or not 1 <= self.count <= MAX_SHARES:  # not a bool either
            raise ConfigurationError(f"tenant share count {self.count!r:.40}: give 1 to {MAX_SHARES}")
        if type(self.index) is not int or not 0 <= self.index < self.count:
            raise ConfigurationError(
                f"tenant share {self.index!r:.40} of {self.count}: give 0 to {self.count - 1}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> TenantShare:
        """``K/N`` (the command line's ``--tenant-share``): share K of N, K from 0 to N - 1."""
        found = _SHARE.fullmatch(text.strip())
        if found is None:
            raise ConfigurationError(f"tenant share {text!r:.40}: give K/N, share K (0 to N - 1) of N "
                                     "processes, e.g. 0/2")
        return cls(int(found[1]), int(found[2]))

    def holds(self, name: str) -> bool:
        """Whether the tenant named ``name`` is this share's (``share_of``)."""
        return share_of(name, self.count) == self.index


def share_of(name: str, count: int) -> int:
    """The share (0 to ``count - 1``) of the tenant named ``name``: its name's BLAKE2b digest modulo
    ``count``. A stable digest, not ``hash()``: Python salts that in every process."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def shared(tenants: TenantsLike, share: TenantShare) -> TenantSource:
    """``tenants``' tenants of ``share`` only (``TenantShare``), for what works per tenant beside a
    shared fleet (its retention). A ``TenantRelay`` takes ``share=`` instead: it reads every tenant
    of the source, to refuse two names of one schema in two shares."""
    source = tenant_source(tenants)

    def read() -> list[Tenant]:
        return [tenant for tenant in source() if share.holds(tenant.name)]
    return read


def checked_tenants(tenants: Iterable[Tenant | str]) -> list[Tenant]:
    """``tenants`` as ``Tenant``s, refusing a duplicate name or address by name."""
    out: list[Tenant] = []
    names: set[str] = set()
    addresses: dict[tuple[str | None, str | None], str] = {}
    for item in tenants:
        tenant = Tenant(name=item, schema=item) if isinstance(item, str) else item
        if not isinstance(tenant, Tenant):
            raise ConfigurationError(f"a tenant must be a Tenant or a schema name, got {type(item).__name__}")
        if tenant.name in names:
            raise ConfigurationError(f"tenant {tenant.name!r} is listed twice")
        if tenant.address in addresses:
            raise ConfigurationError(f"tenants {addresses[tenant.address]!r} and {tenant.name!r} name the "
                                     "same schema of one database")
        names.add(tenant.name)
        addresses[tenant.address] = tenant.name
        out.append(tenant)
    return out


def schemas_like(engine: Engine, pattern: str) -> TenantSource:
    """Every schema of ``engine``'s database whose name matches ``pattern``: ``%`` is the one wildcard.

    ``%`` matches any run of characters (none included); every other character
    matches itself, case included. SQL's ``LIKE`` would also take ``_`` for
    "any one character", so that ``tenant_%`` matched ``tenants`` and
    ``tenantX…``: schema names are full of ``_``, and a tenant served by
    accident sends its rows under its own name. Each schema matched becomes a
    tenant named after it. Schemas appear and disappear with the application's
    own ``CREATE SCHEMA`` / ``DROP SCHEMA``; a schema that matches but holds no
    outbox tables is reported by whoever serves it. On MySQL and MariaDB a
    schema is a database of the server; on SQLite, a database attached to the
    engine's connections.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ConfigurationError("schemas_like needs a pattern such as 'tenant_%' ('%' matches any run of "
                                 "characters, everything else itself)")
    matches = re.compile(".*".join(re.escape(part) for part in pattern.split("%")), re.DOTALL).fullmatch

    def schemas() -> list[Tenant]:
        names = [name for name in _schema_names(engine) if isinstance(name, str) and matches(name)]
        return checked_tenants(_valid_schemas(sorted(names)))
    return schemas


def _schema_names(engine: Engine) -> list[str]:
    """The names of the schemas of ``engine``'s database, as its server spells them."""
    if engine.dialect.name == "sqlite":  # outside a transaction, which would wait for a writer
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("PRAGMA database_list")
            return [row[1] for row in cursor.fetchall() if row[1] not in ("main", "temp")]
        finally:
            raw.close()
    with engine.connect() as conn:
        return list(conn.scalars(sa.text("SELECT schema_name FROM information_schema.schemata")))


_skipped: set[str] = set()


def _valid_schemas(names: Iterable[str]) -> list[Tenant]:
    """Schemas whose names are identifiers; another (``"Tenant A"``) cannot hold our tables by name.

    A schema left out is logged once per process, so a tenant is never missing unsaid.
    """
    tenants = []
    for name in names:
        if isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,40}", name):
            tenants.append(Tenant(name=name, schema=name))
        elif name not in _skipped and len(_skipped) < 1000:
            _skipped.add(name)
            log.warning("schema %r matches the tenants pattern but is not served: a tenant schema's "
                        "name is letters, digits and '_', at most 41 characters", name)
    return tenants


def from_query(engine: Engine, sql: str) -> TenantSource:
    """Tenants from a query of the application's own: rows of (name, schema[, database URL]).

    ``schema`` may be NULL (the database's default schema), and so may the
    URL (``engine``'s database).
    """
    statement = sa.text(sql)

    def query() -> list[Tenant]:
        with engine.connect() as conn:
            rows = conn.execute(statement).all()
        tenants = []
        for row in rows:
            if len(row) not in (2, 3):
                raise ConfigurationError(
                    f"the tenants query must return (name, schema[, database]), got {len(row)} columns")
            tenants.append(Tenant(name=row[0], schema=row[1], database=row[2] if len(row) == 3 else None))
        return checked_tenants(tenants)
    return query


def from_file(path: str | Path) -> TenantSource:
    """Tenants from a JSON file, read again at every refresh.

    The file is a list of objects ``{"name": ..., "schema": ..., "database": ...}``
    (``schema`` and ``database`` optional), or of plain schema names. A database
    URL may name an environment variable instead, ``{"database_env": "ACME_DB"}``,
    to keep its password out of the file.
    """
    import os

    file = Path(path)

    def read() -> list[Tenant]:
        try:
            items: Any = json.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"cannot read the tenants file {str(file)!r}: {exc.strerror}") from None
        except ValueError as exc:
            raise ConfigurationError(f"the tenants file {str(file)!r} is not JSON: {exc}") from None
        if not isinstance(items, list):
            raise ConfigurationError(f"the tenants file {str(file)!r} must hold a JSON list")
        tenants: list[Tenant | str] = []
        for item in items:
            if isinstance(item, str):
                tenants.append(item)
                continue
            if not isinstance(item, dict) or not set(item) <= {"name", "schema", "database", "database_env"}:
                raise ConfigurationError(
                    f"the tenants file {str(file)!r}: each entry is a schema name or an object with "
                    f"name, schema, database or database_env; got {item!r:.80}")
            database = item.get("database")
            if "database_env" in item:
                variable = item["database_env"]
                database = os.environ.get(variable) if isinstance(variable, str) else None
                if not database:
                    raise ConfigurationError(
                        f"tenant {item.get('name')!r:.70}: environment variable {variable!r:.70} is not set")
            tenants.append(Tenant(name=item.get("name", ""), schema=item.get("schema"), database=database))
        return checked_tenants(tenants)
    return read


def parse_tenants(spec: str, engine: Engine) -> TenantSource:
    """The command line's ``--tenants``: where the tenants of ``engine``'s database (or others) come from.

    ``like:PATTERN`` (schemas whose name matches PATTERN, ``%`` its one
    wildcard), ``file:PATH`` (a JSON file, see ``from_file``), ``query:SQL``
    (``from_query``), or a comma-separated list of schema names.
    """
    kind, _, rest = spec.partition(":")
    if kind == "like" and rest:
        return schemas_like(engine, rest)
    if kind == "file" and rest:
        return from_file(rest)
    if kind == "query" and rest:
        return from_query(engine, rest)
    names = [name.strip() for name in spec.split(",")]
    if not spec.strip() or any(not name for name in names):
        raise ConfigurationError(
            f"--tenants {spec!r:.80}: give like:PATTERN, file:PATH, query:SQL or schema names "
            "separated by commas")
    return tenant_source(names)
