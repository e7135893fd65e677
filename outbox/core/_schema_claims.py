"""One tenant per schema, decided by what the database server says, not by how a URL is spelled.

Two tenants whose URLs spell one database in two ways (``localhost`` and
``127.0.0.1``, an added ``?connect_timeout=10``, another user) and that name
one schema in it share their tables: a relay would send that schema's rows
under whichever tenant took the leases first, an inbox would apply a message
id once for both. ``SchemaClaims`` compares the schemas' identities
(``outbox.core._identity``) instead:

- ``refuse_shared`` checks a whole reading of the tenant source at once, as
  the duplicate names are checked: the reading is refused, by name. A tenant
  whose database does not answer then is left for ``claim``.
- ``claim`` is asked before a tenant's tables are first used: it refuses a
  schema another tenant (or the inbox's default database) already has.
  ``release`` gives the schema back when the tenant leaves.

Each identity costs one query per database (cached per connection pool), not
one per tenant or per message.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from sqlalchemy import Engine

from ._errors import ConfigurationError
from ._identity import SchemaIdentity, schema_identity
from ._outage import is_database_outage
from ._tenant import Tenant


class SharedSchemaError(ConfigurationError):
    """A tenant's schema is another tenant's, or a reserved one (the inbox's default database's)."""


DEFAULT_DATABASE_REFUSAL = (
    "tenant {tenant}: its inbox tables would be the default database's ({schema}), where the messages "
    "of no known tenant park; give it a schema or a database of its own")
"""What an inbox says of a tenant whose tables would be its default database's own."""


@dataclass(frozen=True, slots=True)
class _Claim:
    holder: Hashable
    tenant: str | None
    """The tenant's name; None for a reservation (``refusal`` says why)."""
    refusal: str = ""

    def refused(self, tenant: str, identity: SchemaIdentity) -> SharedSchemaError:
        if self.tenant is None:
            return SharedSchemaError(self.refusal.format(tenant=tenant, schema=identity))
        return _shared(self.tenant, tenant, identity)


class SchemaClaims:
    """Which tenant has each schema, by the schema's identity. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[SchemaIdentity, _Claim] = {}
        self._of: dict[Hashable, SchemaIdentity] = {}

    def reserve(self, holder: Hashable, engine: Engine, schema: str | None, refusal: str) -> None:
        """Keep ``schema`` of ``engine``'s database from every tenant; ``refusal`` says why.

        ``refusal`` is formatted with ``tenant`` (the name refused) and ``schema``
        (the schema's identity). Raises what the database raises when it does not answer.
        """
        self._hold(_Claim(holder, None, refusal), schema_identity(engine, schema))

    def refuse_shared(self, tenants: Iterable[tuple[Tenant, Engine]]) -> None:
        """``ConfigurationError`` naming two of ``tenants`` (each on its database's engine) in one schema.

        Also when one of them is in a reserved schema. A tenant whose database
        does not answer now is not looked at: ``claim`` refuses it before it is served.
        """
        with self._lock:
            reserved = {identity: claim for identity, claim in self._held.items() if claim.tenant is None}
        seen: dict[SchemaIdentity, _Claim] = dict(reserved)
        for tenant, engine in tenants:
            try:
                identity = schema_identity(engine, tenant.schema)
            except Exception as exc:
                if is_database_outage(exc):
                    continue
                raise
            if identity in seen:
                raise seen[identity].refused(tenant.name, identity)
            seen[identity] = _Claim(tenant, tenant.name)

    def claim(self, holder: Hashable, tenant: Tenant, engine: Engine) -> None:
        """Hold ``tenant``'s schema for ``holder`` (what serves it), or ``SharedSchemaError`` by name.

        Raises what the database raises when it does not answer (an outage:
        ask again later). Claiming again what ``holder`` holds is a dictionary look-up.
        """
        with self._lock:
            if holder in self._of:
                return
        self._hold(_Claim(holder, tenant.name), schema_identity(engine, tenant.schema))

    def release(self, holder: Hashable) -> None:
        """Give back what ``holder`` holds (its tenant left, or was pointed elsewhere)."""
        with self._lock:
            identity = self._of.pop(holder, None)
            if identity is not None and self._held[identity].holder == holder:
                del self._held[identity]

    def retain(self, holders: Iterable[Hashable]) -> None:
        """Give back what the tenants' holders but ``holders`` hold (reservations stay)."""
        keep = set(holders)
        with self._lock:
            gone = [claim.holder for claim in self._held.values()
                    if claim.tenant is not None and claim.holder not in keep]
        for holder in gone:
            self.release(holder)

    def _hold(self, claim: _Claim, identity: SchemaIdentity) -> None:
        with self._lock:
            held = self._held.get(identity)
            if held is not None and held.holder != claim.holder:
                raise held.refused(claim.tenant or "", identity)
            self._held[identity] = claim
            self._of[claim.holder] = identity


def _shared(first: str, second: str, identity: SchemaIdentity) -> SharedSchemaError:
    return SharedSchemaError(
        f"tenants {first!r} and {second!r} name the same schema of one database ({identity})")
