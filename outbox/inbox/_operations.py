"""The operators' actions of ``Inbox`` on parked messages: list, replay, discard, per tenant.

They find the admin of the place the messages are in (the inbox's own
database, or a tenant's) and hand the action to it; ``ParkedActions`` adds the
audit trail the command line and the console keep. A mixin of ``Inbox`` by
role: it reads the two attributes below, which ``Inbox`` sets.
"""

from __future__ import annotations

import uuid

from ..core._errors import ConfigurationError
from ._admin import ParkedAdmin, ParkedMessage, ParkedReplay
from ._tenants import TenantRouter


class ParkedOperations:
    """``parked``, ``replay`` and ``discard`` of ``Inbox``; safe from several threads."""

    admin: ParkedAdmin
    router: TenantRouter | None

    def _at(self, tenant: str | None) -> ParkedAdmin:
        """The parked-key admin of ``tenant`` (None: the inbox's own database)."""
        if tenant is None:
            return self.admin
        if self.router is None:
            raise ConfigurationError("tenant= is for an inbox serving tenants (Inbox(tenants=…))")
        return self.router.place(tenant).admin

    def parked(self, topic: str | None = None, key: str | None = None, *,
               tenant: str | None = None) -> list[ParkedMessage]:
        """Parked messages of this group, per key in seq order.

        ``tenant``: of that tenant (an inbox serving tenants); without it, the
        inbox's own database (there, the messages of no known tenant).
        """
        return self._at(tenant).parked(topic, key)

    def replay(self, topic: str, key: str | None, *, tenant: str | None = None) -> ParkedReplay:
        """Re-run a parked key's messages in seq order; unpark it when all succeed.

        ``key=None`` re-runs the topic's parked unkeyed messages. ``tenant``:
        the key of that tenant. On an inbox serving tenants, without
        ``tenant``, the key's messages parked as ``tenant_unknown`` go to their
        tenants (which must be served now), as if they had just arrived.
        """
        if tenant is None and self.router is not None:
            return self.router.replay_unknown(topic, key)
        return self._at(tenant).replay(topic, key)

    def discard(self, message_id: uuid.UUID | str, *, by: str, reason: str,
                tenant: str | None = None) -> None:
        """Skip one parked message for good, recording who discarded it, when and why.

        Raises ``DiscardRefusedError`` while an earlier message of its key is
        parked (replay or discard that one first): nothing may be skipped over.
        ``tenant``: a message parked in that tenant's place.
        """
        self._at(tenant).discard(message_id, by=by, reason=reason)
