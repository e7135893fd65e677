"""The inbox per tenant: one consumer, each message applied in its own tenant's schema or database.

An ``Inbox`` given ``tenants=`` keeps one consumer (one group, one Kafka
consumer, one offset tracker, one key scheduler) and routes every delivery to
a *place*: its tenant's sessions, store, transaction step, settle stage,
parked-key admin and gap sweeper, the very same objects a single-database
inbox has, built on the tenant's engine. Nothing in a transaction knows about
tenants: a batch is one tenant's (``_schedule``), so it runs where it would
run in an inbox of that tenant alone, with the same promises.

- **Where:** a tenant's sessions are bound to its database's engine, with
  ``schema_translate_map={None: schema}`` when it has a schema: the inbox
  tables and the handler's own unqualified tables land in the tenant's schema,
  in one transaction. One engine (one pool) per database, shared by its
  tenants: ``execution_options`` copies share the pool.
- **Which:** the tenant is named by a record header (``tenant_header``) or by
  ``tenant_of(message)``; ``Delivery.tenant`` carries it, and the scheduler's
  turn includes it, so tenant A's key "k" and tenant B's key "k" are two keys.
- **Isolation:** each place has an ``OutageGate``. A tenant whose database fails
  (or whose inbox tables are missing) closes its gate: its deliveries go back
  to their lanes on a timer without touching the database, and one *probe*
  at a time tries again after the backoff. Nothing counts as an attempt; the
  outage is logged once per tenant. A database that hangs instead of failing
  (a frozen host) holds the workers whose transactions it took: when the
  tenants span several database servers, one server's transactions take at
  most half the workers at a time (``core._slots.Slots``, counted by what the
  server says it is: its databases hang together), so the others' tenants keep the
  rest. The offset tracker holds the commit below its unfinished records
  (at-least-once; dedup drops the redelivery).
- **Unknown tenant:** a message whose header is missing, names no tenant
  served, or whose ``tenant_of`` raised is parked alone in the default
  database with reason ``tenant_unknown`` (one alert per tenant name and
  process); one that cannot be read is parked there for what it is
  (``foreign``, ``undecodable``), so no replay ever hands it to a handler.
  A message naming a tenant is parked so only after a reading of
  the tenant source that began after the message was received (the source is
  read again for it, at most once a second; meanwhile, and while the source
  cannot be read, it waits): a tenant added before its first message is found. ``replay`` of such a message
  (``Inbox.replay(topic, key)`` without ``tenant``) sends it to its tenant once
  the tenant exists: it arrives there as if just received.
- **Refresh:** the tenant source is read again every ``refresh`` seconds (by
  the sweep); a tenant removed takes no new messages (they park as unknown),
  a tenant added is served from then on.

The roles, a module each: ``_places`` (a ``Place``: one tenant's pipeline and
its gate), ``_tenant_places`` (the tenants read from the source, a
place each), ``_tenant_sweep`` (the sweeps across places) and this one, the
``TenantRouter``: which tenant a message names, the settle stage through each
place's gate, and the parked messages of no known tenant.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError

from transports._logsafe import safe_logger

from ..core import _schema
from ..core._alerts import Alert, AlertKind, deliver
from ..core._envelope import Message
from ..core._errors import OutboxError
from ..core._outage import is_missing_schema
from ..core._schema_claims import SharedSchemaError
from ..core._tenant import Tenant, TenantSource
from ..core._validation import folded
from ._admin import NotParkedError, ParkedReplay
from ._delivery import Delivery, Named, Origin, Unnamed, delivery
from ._kinds import Reason
from ._outage import BACKOFF, is_outage
from ._places import BuildPlace, Place
from ._settle import Settled, settle_alone
from ._signals import Disposition
from ._tenant_places import REFRESH as REFRESH
from ._tenant_places import TenantPlaces, server_of
from ._tenant_sweep import TenantSweeps
from .storage import ParkedRow

log = safe_logger("outbox.inbox")

NO_TENANT = ""
"""The name ``name_of`` gives a message that names no tenant."""
_MAX_ALERTED = 10_000


class TenantRouter:
    """Routes deliveries to their tenant's place; settles, sweeps and counts across places.

    Takes the roles of the settle stage and the gap sweeper in the runner
    (``settle``, ``ready``, ``park_stale``, ``parked_key_count``). The tenants
    and their places are ``TenantPlaces``'; the sweeps ``TenantSweeps``'.
    Thread-safe.
    """

    def __init__(self, source: TenantSource, *, default: Place, build: BuildPlace,
                 header: str | None, tenant_of: Callable[[Message], str | None] | None,
                 refresh: float, pool_size: int) -> None:
        self.places = TenantPlaces(source, default=default, build=build, refresh=refresh,
                                   pool_size=pool_size)
        self.sweeps = TenantSweeps(self.places)
        self.default = default
        self.header = header
        self._folded = folded(header) if header is not None else None
        self.tenant_of = tenant_of
        self._missing: set[str] = set()  # places whose tables were reported missing
        self._alerted: set[str] = set()

    # -- the tenants ------------------------------------------------------------

    def refresh(self, *, force: bool = False, at_most_every: float | None = None,
                wait: bool = True) -> bool:
        """Read the tenant source again when due (``TenantPlaces.refresh``)."""
        return self.places.refresh(force=force, at_most_every=at_most_every, wait=wait)

    @property
    def tenants(self) -> list[Tenant]:
        """The tenants served, as last read (read now if never read)."""
        return self.places.tenants

    def place(self, name: str | None) -> Place:
        """The place of tenant ``name`` for an operator (None: the default database)."""
        return self.places.place(name)

    # -- which tenant -------------------------------------------------------------

    def name_of(self, message: Message) -> tuple[str, str | None]:
        """(tenant name or "", why it names none) for ``message``; never raises.

        Whatever ``tenant_of`` returns or raises (an object whose ``==`` or
        ``str()`` raises, a ``str`` subclass) is looked at only through
        ``isinstance`` and ``str``'s own methods: the consumer thread calls this.
        """
        if self.tenant_of is not None:
            try:
                named = self.tenant_of(message)
            except Exception as exc:
                return NO_TENANT, f"tenant_of raised {_described(exc)}"
            if named is None:
                return NO_TENANT, "tenant_of named no tenant"
            if not isinstance(named, str):
                return NO_TENANT, f"tenant_of returned a {type(named).__name__:.80}, not a tenant name"
            name = str.__getitem__(named, slice(None, 200))  # a plain str, whatever the subclass
            if not name:
                return NO_TENANT, "tenant_of named no tenant"
            return name, None
        # The header is its name in any case (``X-Tenant`` is ``x-tenant``). The relay replaces
        # every spelling of it with one, so two spellings with two values came from elsewhere:
        # which tenant they name depends on the reader, so they name none.
        values = {v for n, v in message.headers.items() if folded(n) == self._folded}
        if len(values) > 1:
            return NO_TENANT, f"the {self.header!r} header spelled twice with different values"
        value = values.pop() if values else ""
        if not value:
            return NO_TENANT, f"no {self.header!r} header"
        return value[:200], None

    def tag(self, d: Delivery) -> Delivery:
        """``d`` with the tenant it names, or why it names none."""
        name, why = self.name_of(d.message)
        return dataclasses.replace(d, tenant=Named(name) if why is None else Unnamed(why))

    # -- the settle stage ---------------------------------------------------------

    def settle(self, batch: list[Delivery]) -> Settled:
        """Settle a batch of one tenant at its place; an unknown tenant's are parked as such."""
        tenant = batch[0].tenant
        name = tenant.name if isinstance(tenant, Named) else NO_TENANT
        place = self.places.serving(name, max(d.received_at for d in batch))
        if isinstance(place, float):
            return Settled(later=[(d, place) for d in batch])
        if place is None:
            return self._park_unknown(batch)
        return _of_tenant(self._at(place, batch, lambda: place.settler.settle(batch)), tenant)

    def _park_unknown(self, batch: list[Delivery]) -> Settled:
        """Park messages of no known tenant in the default database: unreadable ones for what they are.

        A record that cannot be read (foreign, undecodable) is never to be
        applied anywhere: parked as ``tenant_unknown``, replay would send it to
        its tenant as if it were a message and apply it. It is parked as a
        single-database inbox parks it (``foreign``, ``undecodable``), in the
        default database; the others as ``tenant_unknown``.
        """
        unreadable = [d for d in batch if d.unreadable is not None]
        readable = [d for d in batch if d.unreadable is None]
        default = self.default
        settled = Settled()
        if unreadable:
            settled = self._at(default, unreadable, lambda: default.settler.settle(unreadable))
        if readable:
            rest = self._at(default, readable, lambda: self._parked_unknown(readable))
            settled = Settled(done=settled.done + rest.done, later=settled.later + rest.later)
        return settled

    def _at(self, place: Place, batch: list[Delivery], settle: Callable[[], Settled]) -> Settled:
        """Run ``settle`` at ``place`` through its gate: put off while closed, closed by an outage."""
        server = server_of(place.engine)  # given back by the key it was taken by, known since or not
        slots = self.places.slots
        if not slots.take(server):
            return Settled(later=[(d, BACKOFF.first) for d in batch])
        try:
            return self._through_gate(place, batch, settle)
        finally:
            slots.give_back(server)

    def _through_gate(self, place: Place, batch: list[Delivery], settle: Callable[[], Settled]) -> Settled:
        wait = place.gate.admit()
        if wait is not None:
            return Settled(later=[(d, wait) for d in batch])
        try:
            return self._settle_at(place, batch, settle)
        finally:
            place.gate.probed()  # a probe that raised hands the probing on

    def _settle_at(self, place: Place, batch: list[Delivery], settle: Callable[[], Settled]) -> Settled:
        """``settle`` once the place's tables are known to be there; an outage closes its gate."""
        if not place.checked:
            started = time.monotonic()
            delay = self._check(place)
            if delay is not None:
                return self._unchecked(place, batch, delay)
            # Its tables are there and its database answered: open, and swept again. Left closed
            # until the batch settled, a server that froze under that batch went unswept, and its
            # reads, the one watch that tells a frozen server (``_gaps``), never began.
            place.gate.answered(started)
        try:
            settled = settle()
        except DBAPIError as exc:
            # Not an outage (those settle as "later"): the tables went away under us? Check them.
            delay = self._check(place)
            if delay is None:
                if not is_missing_schema(exc):
                    raise
                delay = BACKOFF.first  # missing when it ran, made since: try it again, count nothing
            log.warning("%s: inbox transaction failed (%s); its tables are checked again before "
                        "it is used", place.what, type(exc).__name__)
            return self._unchecked(place, batch, delay)
        if place.settler.outages.down:
            place.gate.close(max((delay for _, delay in settled.later), default=BACKOFF.first))
            place.swept_shut = False  # its put-off deliveries probe it, not the sweep's reads
        else:
            place.gate.answered()
        return settled

    @staticmethod
    def _unchecked(place: Place, batch: list[Delivery], delay: float) -> Settled:
        """The place's gate closed for ``delay``; its tables are checked again before it is used."""
        place.gate.close(delay)
        place.checked = False
        return Settled(later=[(d, delay) for d in batch])

    def _check(self, place: Place) -> float | None:
        """None when ``place``'s inbox tables are there; else the seconds before the next look."""
        try:
            self.places.claim(place)
            place.sessions.run(functools.partial(_schema.check, inbox=True), place.engine, place.tables)
        except Exception as exc:
            if is_outage(exc):
                return place.settler.outages.failed(exc)
            if not isinstance(exc, OutboxError | DBAPIError):
                raise
            name = place.name or ""
            if name not in self._missing and isinstance(exc, SharedSchemaError):
                self._missing.add(name)
                log.error("%s: not served: %s; its messages wait, the other tenants go on", place.what, exc)
            elif name not in self._missing:
                self._missing.add(name)
                log.error("%s: its inbox tables are not usable (%s); its messages wait, the other "
                          "tenants go on. Create them (`outbox init-db`, or Inbox.create_tables(tenant=…))",
                          place.what, str(exc).splitlines()[0][:300])
            place.missing_looks += 1
            return BACKOFF.delay(place.missing_looks)
        place.settler.outages.answered()
        place.checked = True
        place.missing_looks = 0
        if place.name in self._missing:
            self._missing.discard(place.name or "")
            log.warning("%s: its inbox tables are there now", place.what)
        return None

    def _parked_unknown(self, batch: list[Delivery]) -> Settled:
        """Park readable messages of no known tenant, alone, reason ``tenant_unknown``."""
        default = self.default
        whys = [self._why_unknown(d) for d in batch]
        try:
            default.sessions.run(self._park_rows, batch, whys)
        except Exception as exc:
            if not is_outage(exc):
                raise
            delay = default.settler.outages.failed(exc)
            return Settled(later=[(d, delay) for d in batch])
        default.settler.outages.answered()
        for d, why in zip(batch, whys, strict=True):
            default.settler.alerter.metrics.parked(d.message.topic, Reason.TENANT_UNKNOWN)
            self._alert_unknown(d, why)
        return Settled(done=[(d, Disposition.PARKED) for d in batch])

    def _why_unknown(self, d: Delivery) -> str:
        """What ``tag`` found: the same answer the routing had (``tenant_of`` is not asked twice)."""
        tenant = d.tenant
        if isinstance(tenant, Named):
            return f"tenant {tenant.name!r} is not among the inbox's tenants"
        return tenant.why if isinstance(tenant, Unnamed) else "it names no tenant"

    def _park_rows(self, batch: list[Delivery], whys: list[str]) -> None:
        store = self.default.store
        with self.default.sessions() as session, session.begin():
            for d, why in zip(batch, whys, strict=True):
                store.park(session, d, Reason.TENANT_UNKNOWN, error=why)

    def _alert_unknown(self, d: Delivery, why: str) -> None:
        """One alert per tenant name (or per "names none") and process."""
        name = d.tenant.name if isinstance(d.tenant, Named) else NO_TENANT
        if name in self._alerted or len(self._alerted) >= _MAX_ALERTED:
            return
        self._alerted.add(name)
        alerter = self.default.settler.alerter
        deliver(alerter.sink, Alert(
            kind=AlertKind.MESSAGE_PARKED, topic=d.message.topic, key=d.message.key,
            message_id=str(d.message.message_id), group=alerter.group,
            error=f"{why}: parked in the default database (reason tenant_unknown); replay it "
                  "once its tenant is served",
            details={"reason": Reason.TENANT_UNKNOWN.value, "tenant": name or None,
                     "seq": d.message.seq, "partition": d.partition, "offset": d.offset}))

    # -- the sweep (``TenantSweeps``) ---------------------------------------------------

    def ready(self) -> list[Delivery]:
        """Held messages next in their key that the sweeps finished since the last call found."""
        return self.sweeps.ready()

    def park_stale(self) -> int:
        """Nothing to do here: ``ready``'s sweeps park the stale gaps of their places too."""
        return 0

    def sweep(self, places: list[Place] | None = None) -> list[Delivery]:
        """Sweep ``places`` (all, when None) in this thread; also reads the tenant source when due."""
        return self.sweeps.sweep(places)

    def parked_key_count(self) -> int:
        """Parked keys of every tenant, as last counted by the sweep."""
        return self.sweeps.parked_key_count()


    # -- operators ----------------------------------------------------------------

    def replay_unknown(self, topic: str, key: str | None) -> ParkedReplay:
        """Send the key's ``tenant_unknown`` messages to their tenants, in seq order per tenant.

        A message whose tenant is still unknown stays, and with it the later
        ones naming the same tenant (or none). Each other one is settled in its
        tenant's place as if it had just arrived (applied, held behind a gap, a
        duplicate, or — its handler failing ``max_attempts`` times — parked
        there, alerted: then replay it with ``tenant=``), and only then leaves
        the default database's ``inbox_parked``.
        """
        self.refresh(force=True)
        default = self.default
        rows = [r for r in default.sessions.run(self._unknown_rows, topic, key)
                if r.reason is Reason.TENANT_UNKNOWN]
        if not rows:
            name = f"key {key!r}" if key is not None else "unkeyed message"
            raise NotParkedError(f"no {name} of topic {topic!r} is parked as tenant_unknown in "
                                 f"group {default.store.group!r}")
        moved, stuck, error = 0, set[str](), None
        for row in rows:
            name, why = self.name_of(row.delivery.message)
            place = self.places.get(name) if name else None
            if place is None or name in stuck:
                # Its tenant is still unknown: it stays, and so do the later ones naming the same.
                stuck.add(name)
                error = error or why or f"tenant {name!r} is still not among the inbox's tenants"
                continue
            self.places.claim(place)
            d = delivery(row.delivery.message, row.delivery.partition, row.delivery.offset,
                         origin=Origin.CALLER)
            # The live path's settle stage: apply, retries, park and alerts as for a new arrival.
            settle_alone(place.settler.settle, dataclasses.replace(d, tenant=Named(name)))
            default.sessions.run(self._unpark, row.id)
            moved += 1
        remaining = len(rows) - moved
        return ParkedReplay(applied=moved, remaining=remaining, unparked=not remaining, error=error)

    def _unknown_rows(self, topic: str, key: str | None) -> list[ParkedRow]:
        with self.default.sessions() as session:
            return self.default.store.parked.rows(session, topic, key)

    def _unpark(self, row_id: int) -> None:
        with self.default.sessions() as session, session.begin():
            self.default.store.parked.remove(session, row_id)


def _described(exc: BaseException) -> str:
    """``exc`` as stored and alerted: its type and text, escaped (no NUL, no surrogate), short."""
    try:
        text = str(exc)
    except Exception:
        text = "(its text cannot be shown)"
    return f"{type(exc).__name__:.80}: {repr(text)[1:-1][:200]}"


def _of_tenant(settled: Settled, tenant: Named | Unnamed | None) -> Settled:
    """``settled`` with ``tenant`` on what comes back without one.

    A transaction takes up a key's held messages right after their predecessor,
    read from ``inbox_held``, which names no tenant (its rows are the tenant's
    own): what of them comes back to wait (deferred by ``batch_budget``, blocked
    behind a failure) would otherwise name none, and be parked as
    ``tenant_unknown`` in the default database on its next turn.
    """
    if all(d.tenant is not None for d, _ in settled.later):
        return settled
    settled.later = [(d if d.tenant is not None else dataclasses.replace(d, tenant=tenant), delay)
                     for d, delay in settled.later]
    return settled
