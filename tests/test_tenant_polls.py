"""An idle tenant's polls back off while notifications can wake it, and keep every promise a poll kept.

Fetches are counted (every ``RelayStep.run_batch`` of each tenant), not waited
for: an idle tenant of a PostgreSQL database whose LISTEN connection is up is
polled rarely; where no notification can come (MariaDB, no channel) it is polled
every ``poll_interval`` as before. What a poll protects still holds with the
polls rare: a delayed row goes out when it comes due, and a row whose
notification was lost is found once the LISTEN connection breaks and is back.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
import tenacity
from _relay_helpers import Running, pending, wait_for

from outbox import Alert, Outbox, Relay, create_engine
from outbox.relay import RelayStep
from outbox.tenants import Tenant, TenantRelay
from outbox.tenants._idle_polls import MAX_IDLE_POLL, IdlePolls
from outbox.tenants._shares import LIVE_WINDOW, SHARED_BATCH, YIELD_AT_MOST, BacklogShares
from transports import Outcome, Record, SendResult
from transports.memory import InMemoryBroker, InMemoryTransport

ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""


class Fetches:
    """The moments (``time.monotonic()``) of each tenant's steps, by tenant name: its polls, and
    its turns when woken (an idle poll that finds nothing due fetches nothing: ``run(probe=True)``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()
        original = RelayStep.run

        def counting(step: RelayStep, **kwargs: Any) -> Any:
            with self._lock:
                self.at[step.name.rsplit("tenant ", 1)[1]].append(time.monotonic())
            return original(step, **kwargs)
        monkeypatch.setattr(RelayStep, "run", counting)

    def between(self, name: str, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for at in self.at[name] if start <= at < end)

    def in_next(self, name: str, seconds: float) -> int:
        """The tenant's fetches in the next ``seconds``: no condition to wait for, only fetches to count."""
        began = time.monotonic()
        time.sleep(seconds)
        return self.between(name, began, time.monotonic())

    def backed_off(self, name: str, gap: float) -> bool:
        """The tenant's last two fetches are ``gap`` seconds apart or more."""
        with self._lock:
            at = self.at[name]
            return len(at) >= 2 and at[-1] - at[-2] >= gap


@pytest.fixture
def running() -> Iterator[list[Running]]:
    fleets: list[Running] = []
    yield fleets
    for fleet in fleets:
        fleet.stop()


def start(fleets: list[Running], tenants: list[Any], database: Any, **kwargs: Any) -> Running:
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    options: dict[str, Any] = dict(tenant_header="x-tenant", poll_interval=0.1, lease_ttl=3.0,
                                   refresh_every=60.0, database=database)
    options.update(kwargs)
    fleet = Running(TenantRelay(tenants, lambda: InMemoryTransport(broker), **options))
    fleets.append(fleet)
    names = sorted(t.name if isinstance(t, Tenant) else t for t in tenants)
    wait_for(lambda: fleet.relay.tenants == names, 30, "every tenant served")
    return fleet


def schema_outbox(engine: sa.Engine, name: str, **kwargs: Any) -> Outbox:
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    outbox = Outbox(engine, schema=name, shards=4, **kwargs)
    outbox.create_tables()
    return outbox


def listening(engine: sa.Engine) -> bool:
    """The fleet's LISTEN connection, as the server shows it."""
    with engine.connect() as conn:
        return bool(conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND starts_with(query, 'LISTEN ')").scalar())


def backed_off(fleets: list[Running], fetches: Fetches, pg: sa.Engine, name: str, *, poll_interval: float,
               gap: float, what: str) -> None:
    """One tenant ``name`` served with notifications, once two of its polls came ``gap`` s apart."""
    start(fleets, [name], pg, poll_interval=poll_interval)
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    wait_for(lambda: fetches.backed_off(name, gap), 30, what)


@dataclass
class Tenantish:
    """What the poll and share policies keep of a tenant (a fleet's ``Unit`` without its step)."""

    idle_turns: int = 0
    backlogged: bool = False


def publish(outbox: Outbox, key: str, **kwargs: Any) -> None:
    with outbox.begin() as session:
        outbox.publish(session, "polls", {"key": key}, key=key, **kwargs)


@pytest.mark.postgres
def test_an_idle_tenant_is_polled_rarely_while_notifications_can_wake_it(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """Polled every 0.1 s, an idle tenant would be fetched ~30 times in 3 s; backing off, once or twice."""
    fetches = Fetches(monkeypatch)
    schema_outbox(pg, "idle")
    start(running, ["idle"], pg)
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    wait_for(lambda: fetches.at["idle"], 20, "its first poll")
    time.sleep(3.0)  # its polls back off meanwhile: 0.2, 0.4, 0.8, 1.6 s apart
    polled = fetches.in_next("idle", 3.0)
    assert polled <= 3, f"an idle tenant was fetched {polled} times in 3 s (poll_interval 0.1 s)"


@pytest.mark.postgres
def test_an_idle_poll_is_one_transaction_with_its_look_ahead_and_stuck_key_check(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """An idle tenant's poll reads the next delayed row and (when due) its stuck keys in its fetch's
    transaction: one connection a poll on the workers, not one for the fetch, one for the delayed
    rows and one for the stuck keys; and with no row retried, the stuck-key check reads nothing
    (the look ahead counted the retried rows). Its stuck-key check is due every second here, and
    its polls, backing off from 0.1 s, come by then: the check falls on (nearly) every poll."""
    fetches = Fetches(monkeypatch)
    checks: list[float] = []
    checkouts: list[float] = []
    original = RelayStep._look_ahead

    def looked(step: RelayStep, conn: sa.Connection, now: float, **kwargs: Any) -> bool | None:
        due = now >= step._watch_due
        found = original(step, conn, now, **kwargs)
        if due:
            checks.append(time.monotonic())
        return found

    def checkout(*_: Any) -> None:
        if threading.current_thread().name.startswith("outbox-relay-worker"):
            checkouts.append(time.monotonic())

    def statement(*_: Any) -> None:
        if threading.current_thread().name.startswith("outbox-relay-worker"):
            statements.append(time.monotonic())
    statements: list[float] = []
    monkeypatch.setattr(RelayStep, "_look_ahead", looked)
    sa.event.listen(pg.pool, "checkout", checkout)
    sa.event.listen(pg, "before_cursor_execute", statement)
    try:
        schema_outbox(pg, "quiet")
        start(running, ["quiet"], pg, poll_interval=0.1, key_stuck_after=1.0)
        wait_for(lambda: listening(pg), 20, "the fleet listening")
        wait_for(lambda: fetches.backed_off("quiet", 0.15), 20, "its polls backing off")
        began = time.monotonic()
        wait_for(lambda: fetches.between("quiet", began, time.monotonic()) >= 6, 20, "six idle polls")
        ended = time.monotonic()
    finally:
        sa.event.remove(pg.pool, "checkout", checkout)
        sa.event.remove(pg, "before_cursor_execute", statement)
    polls = fetches.between("quiet", began, ended)
    connections = sum(1 for at in checkouts if began <= at < ended)
    watched = sum(1 for at in checks if began <= at < ended)
    sent = sum(1 for at in statements if began <= at < ended)
    assert connections <= polls + 1, (connections, polls)  # three a poll before
    assert watched >= polls - 2, (watched, polls)  # the stuck-key check ran at (nearly) every poll
    # The look ahead alone, which found nothing due (no fetch: ``probe``), and the session settings of
    # a connection not set up before; nothing retried, so no stuck-key query.
    assert sent <= polls + 2, (sent, polls)


@pytest.mark.parametrize("where", [pytest.param("mariadb", marks=pytest.mark.mysql),
                                   pytest.param("no channel", marks=pytest.mark.postgres)])
def test_where_no_notification_can_come_every_tenant_is_polled_every_interval(
        where: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """MariaDB has no LISTEN, and a fleet without a channel listens to nothing: a poll is the latency.

    Counted as fetches until there are thirty, not as fetches in a window of wall time (at least
    10 in 3 s: a loaded host that stalled the fleet a second or two would fail it): polled every
    0.1 s they take seconds; backing off (0.2, 0.4, 0.8 ... s, less a quarter at most) the tenth
    alone would come more than 75 s after the first."""
    fetches = Fetches(monkeypatch)
    if where == "mariadb":
        engine = create_engine(request.getfixturevalue("mysql_db"))
        Outbox(engine, shards=4).create_tables()
        tenants: list[Any] = [Tenant("plain")]
        options: dict[str, Any] = {}
    else:
        engine = create_engine(request.getfixturevalue("postgres_db"))
        schema_outbox(engine, "plain")
        tenants, options = ["plain"], {"notify_channel": None}
    request.addfinalizer(engine.dispose)
    running = request.getfixturevalue("running")  # after the database: the fleet stops before it is dropped
    outbox = Outbox(engine, schema=None if where == "mariadb" else "plain", notify_channel=None)
    start(running, tenants, engine, **options)
    wait_for(lambda: fetches.at["plain"], 20, "its first poll")
    wait_for(lambda: len(fetches.at["plain"]) >= 30, 35,
             "thirty polls (poll_interval 0.1 s, no notification): were they backing off, minutes")
    publish(outbox, "late")  # and a row is found by the next poll
    wait_for(lambda: pending(outbox) == 0, 5, "the row found by a poll")


@pytest.mark.postgres
def test_a_delayed_row_goes_out_when_due_though_polls_are_rare(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """Its notification comes at the commit, before it is due; nothing announces that it came due.

    The tenant's polls have backed off to 8 s and more; the row, due 1 s after its commit, is sent
    within a few seconds: the poll after the notified turn is set by the row's ``available_at``.
    """
    fetches = Fetches(monkeypatch)
    outbox = schema_outbox(pg, "later")
    backed_off(running, fetches, pg, "later", poll_interval=0.25, gap=3.5,
               what="its polls 4 s apart (the next 8 s)")
    committed = time.monotonic()
    publish(outbox, "soon", delay=1.0)
    # 5 s: its next poll comes 6 s at least after the one just seen (8 s less a quarter), so only
    # the turn at its due time can send it within the wait.
    wait_for(lambda: pending(outbox) == 0, 5, "the delayed row sent once due")
    assert time.monotonic() - committed >= 1.0 - 0.1  # not before its delay (our clocks agree here)


@pytest.mark.postgres
def test_rows_a_notification_announced_need_no_poll_after_them(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """A tenant whose polls have backed off gets a notified row: its turn sends it, and its polls go
    on backing off. Reset to the poll interval after every turn with work, a fleet draining 500
    tenants polled each again every interval while the others drained (``_idle_polls``): here
    0.1, 0.2, 0.4 and 0.8 s after the send, four fetches in the 1.5 s counted."""
    fetches = Fetches(monkeypatch)
    outbox = schema_outbox(pg, "told")
    backed_off(running, fetches, pg, "told", poll_interval=0.1, gap=1.2,
               what="its polls 1.6 s apart (the next 3.2 s)")
    publish(outbox, "told")
    wait_for(lambda: pending(outbox) == 0, 5, "the notified row sent")
    polled = fetches.in_next("told", 1.5)
    assert polled <= 1, f"polled {polled} times in the 1.5 s after a notified row was sent"


@pytest.mark.postgres
def test_a_silent_writers_burst_keeps_its_tenant_polled_every_interval_after_it_drained(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """A writer that never notifies writes 40 rows: a poll finds them, batches of 5 drain them (the
    turns after the poll are requeued, not polled), and its next row is found a poll interval
    later, not at the backoff the drain's eight turns would have grown (a minute here).

    Backed off to 1.6 s gaps, not 4 s (``poll_interval`` 0.1, not 0.25): the burst is found by a
    backed-off poll either way, and the backoff the drain would grow is the cap either way (60 s, 45
    s at least with its jitter), 15 times the 3 s waited for the next row; 4 s gaps took 10 s more."""
    fetches = Fetches(monkeypatch)
    schema_outbox(pg, "silent")
    silent = Outbox(pg, schema="silent", shards=4, notify_channel=None)
    start(running, ["silent"], pg, poll_interval=0.1, batch_size=5)
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    wait_for(lambda: fetches.backed_off("silent", 1.4), 30, "its polls 1.6 s apart (the next 3.2 s)")
    with silent.begin() as session:
        for i in range(40):
            silent.publish(session, "polls", {"key": f"k{i}"}, key=f"k{i}")
    # Its next poll: 2.4-3.2 s on, or 4.8-6.4 s when the jitter hid the 1.6 s gap.
    wait_for(lambda: pending(silent) == 0, 25, "the burst found by a poll and drained")
    publish(silent, "next")
    wait_for(lambda: pending(silent) == 0, 3, "the next silent row found a poll interval later")


@pytest.mark.postgres
def test_a_delayed_row_beside_a_sent_one_goes_out_when_due_though_polls_are_rare(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """One transaction writes a row due now and one due a second later; the turn its notification
    starts sends the first and reads, on its fetch's connection, when the second comes due: the
    tenant's next poll is then, not at its backoff (6 s and more here)."""
    fetches = Fetches(monkeypatch)
    outbox = schema_outbox(pg, "both")
    backed_off(running, fetches, pg, "both", poll_interval=0.25, gap=3.5,
               what="its polls 4 s apart (the next 8 s)")
    committed = time.monotonic()
    with outbox.begin() as session:
        outbox.publish(session, "polls", {"key": "now"}, key="now")
        outbox.publish(session, "polls", {"key": "soon"}, key="soon", delay=1.0)
    wait_for(lambda: pending(outbox) == 0, 4, "the delayed row sent once due")
    assert time.monotonic() - committed >= 1.0 - 0.1  # not before its delay (our clocks agree here)


@pytest.mark.postgres
def test_a_write_of_outcomes_that_fails_wakes_its_tenant(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """A pipelined write that raises (not an outage) leaves its rows pending, and only the tenant's
    next step reports it and sends them again: with its polls backed off to 6 s and more, the
    failure wakes it, and the rows go out again within seconds."""
    fetches = Fetches(monkeypatch)
    outbox = schema_outbox(pg, "fails")
    backed_off(running, fetches, pg, "fails", poll_interval=0.25, gap=3.5,
               what="its polls 4 s apart (the next 8 s)")
    with pg.begin() as conn:  # the first mark to "published" fails, as a constraint would (no outage)
        conn.exec_driver_sql("CREATE SEQUENCE fails.tries")
        conn.exec_driver_sql(
            "CREATE FUNCTION fails.once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF nextval('fails.tries') = 1 THEN RAISE EXCEPTION 'a write that failed'; END IF; "
            "RETURN NEW; END $$")
        conn.exec_driver_sql(
            "CREATE TRIGGER fail_once BEFORE UPDATE ON fails.outbox_messages FOR EACH ROW "
            "WHEN (NEW.status = 'published') EXECUTE FUNCTION fails.once()")

    def tries() -> int:
        with pg.connect() as conn:
            return int(conn.exec_driver_sql(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM fails.tries").scalar() or 0)
    publish(outbox, "again")
    # The first send comes with the publish's notification, or at the backed-off poll at the latest
    # (a clean-clone CI under load once took more than 5 s): what this test proves is the next wait,
    # the failure waking the tenant well before its next poll.
    wait_for(lambda: tries() >= 1, 12, "the failed write")
    wait_for(lambda: pending(outbox) == 0, 4, "the row sent again and marked")


@pytest.mark.postgres
def test_a_write_that_fails_every_time_is_tried_again_at_the_poll_interval_not_in_a_loop(
        pg: sa.Engine, running: list[Running]) -> None:
    """The wake of a failed write is rate-bound: a write that can never succeed (every mark to
    "published" refused) sends its row again about once a poll interval, not as fast as the broker
    answers, which without the bound was 164 sends in 2 s: three more took milliseconds. Its polls
    may send it too, so three sends take at least half a poll interval or so, not 1.5 s."""
    schema_outbox(pg, "never")
    outbox = Outbox(pg, schema="never", shards=4)
    with pg.begin() as conn:
        conn.exec_driver_sql(
            "CREATE FUNCTION never.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'a write that always fails'; END $$")
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse BEFORE UPDATE ON never.outbox_messages FOR EACH ROW "
            "WHEN (NEW.status = 'published') EXECUTE FUNCTION never.refuse()")
    sends: list[float] = []
    broker = InMemoryBroker(max_record_bytes=ROOMY)

    class Counting(InMemoryTransport):
        def publish(self, records: Sequence[Record]) -> list[SendResult]:
            sends.append(time.monotonic())
            return super().publish(records)

    fleet = Running(TenantRelay(["never"], lambda: Counting(broker), database=pg, poll_interval=0.5,
                                lease_ttl=3.0, refresh_every=60.0))
    running.append(fleet)
    wait_for(lambda: fleet.relay.tenants == ["never"], 30, "the tenant served")
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    publish(outbox, "k")
    wait_for(lambda: len(sends) >= 5, 10, "the row sent again after its failed writes")
    took = sends[4] - sends[1]
    assert took >= 0.3, f"three more sends {took:.3f} s after the second (poll_interval 0.5 s)"


@pytest.mark.postgres
def test_a_row_whose_notification_was_lost_is_found_when_the_listener_breaks_and_is_back(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, running: list[Running]) -> None:
    """A row written without a notification stands for one lost with the LISTEN connection.

    The polls have backed off to 8 s and more; the server ends the fleet's LISTEN connection; the
    fleet polls its tenants when it notices and again when it listens again, so the row goes out
    within seconds, not at the next backed-off poll.
    """
    fetches = Fetches(monkeypatch)
    schema_outbox(pg, "lost")
    unannounced = Outbox(pg, schema="lost", shards=4, notify_channel=None)
    backed_off(running, fetches, pg, "lost", poll_interval=0.25, gap=3.5,
               what="its polls 4 s apart (the next 8 s)")
    publish(unannounced, "lost")
    with pg.connect() as conn:
        ended = conn.exec_driver_sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND starts_with(query, 'LISTEN ')").scalar()
    assert ended == 1
    wait_for(lambda: pending(unannounced) == 0, 5, "the row found after the listener broke")
    wait_for(lambda: listening(pg), 20, "the fleet listening again")


class Refusing:
    """A broker that answers and refuses every record for now: each send is an attempt counted."""

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        return [SendResult(Outcome.RETRY, error="refused for now") for _ in records]

    def close(self, timeout: float = 10.0) -> None:
        pass


@pytest.mark.postgres
def test_a_key_stuck_on_an_idle_tenant_alerts_within_its_bound_and_a_quiet_one_alerts_nothing(
        pg: sa.Engine, running: list[Running]) -> None:
    """A head refused once and retried only 60 s later: from then on its tenant's polls fetch nothing
    (the row is not due), so only an idle poll's look-ahead sees the key stuck. With
    ``key_stuck_after`` 1 s the alert comes within a few seconds, naming its tenant; the other
    tenant, nothing retried, alerts nothing."""
    stuck = schema_outbox(pg, "stuck")
    schema_outbox(pg, "calm")
    alerts: list[Alert] = []
    fleet = Running(TenantRelay(["calm", "stuck"], lambda: Refusing(), database=pg, poll_interval=0.1,
                                lease_ttl=3.0, refresh_every=60.0, key_stuck_after=1.0,
                                backoff=tenacity.wait_fixed(60), alert=alerts.append))
    running.append(fleet)
    wait_for(lambda: fleet.relay.tenants == ["calm", "stuck"], 30, "every tenant served")
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    publish(stuck, "k")
    committed = time.monotonic()
    wait_for(lambda: any(a.kind == "key_stuck" for a in alerts), 10, "the key_stuck alert")
    assert time.monotonic() - committed < 1.0 + 3.0  # its threshold, then a check (every second here)
    assert [(a.kind, a.tenant, a.key) for a in alerts] == [("key_stuck", "stuck", "k")]


IDLE_IN_THE_STUCK_KEY_READ = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND state LIKE 'idle in transaction%' AND query LIKE '%AS behind%'")
"""Sessions left in a transaction after reading the stuck keys (``retrying_heads``' query)."""


@pytest.mark.postgres
def test_an_idle_polls_stuck_key_alert_is_delivered_after_its_transaction_ends(
        pg: sa.Engine, running: list[Running]) -> None:
    """An idle poll reads the stuck keys in its fetch's transaction, but an alert sink may take
    seconds (a webhook POSTs each alert, 5 s timeout, up to 500 a check): delivered inside that
    transaction, it held the poll's snapshot (vacuum of the outbox), its locks (DDL, and whatever
    queues behind DDL) and its connection open for as long, and a server's own
    ``idle_in_transaction_session_timeout`` ended the poll as a database outage. The sink sees no
    session left in a transaction after the stuck-key read."""
    stuck = schema_outbox(pg, "stuck")
    alerts: list[Alert] = []
    inside: list[int] = []

    def sink(alert: Alert) -> None:
        with pg.connect() as conn:
            inside.append(int(conn.scalar(sa.text(IDLE_IN_THE_STUCK_KEY_READ)) or 0))
        alerts.append(alert)

    fleet = Running(TenantRelay(["stuck"], lambda: Refusing(), database=pg, poll_interval=0.1,
                                lease_ttl=3.0, refresh_every=60.0, key_stuck_after=1.0,
                                backoff=tenacity.wait_fixed(60), alert=sink))
    running.append(fleet)
    wait_for(lambda: fleet.relay.tenants == ["stuck"], 30, "the tenant served")
    wait_for(lambda: listening(pg), 20, "the fleet listening")
    publish(stuck, "k")
    wait_for(lambda: any(a.kind == "key_stuck" for a in alerts), 10, "the key_stuck alert")
    assert [(a.kind, a.key) for a in alerts] == [("key_stuck", "k")]
    assert inside == [0], "the alert was delivered inside the poll's transaction"


def test_idle_tenants_started_together_are_polled_apart_and_never_later_than_their_bound() -> None:
    """500 tenants start at once: with equal delays their polls stayed together, a burst of
    fetches once a minute. Each delay is cut by up to a quarter at random, never lengthened."""
    polls = IdlePolls(5.0, rng=random.Random(7))
    units = [Tenantish() for _ in range(500)]
    for turn in range(1, 7):
        nominal = min(MAX_IDLE_POLL, 5.0 * (1 << turn))
        delays = [polls.after_turn(unit, unannounced=False, notified=True) for unit in units]
        assert all(0.75 * nominal <= d <= nominal for d in delays), (turn, min(delays), max(delays))
        assert max(delays) - min(delays) >= 0.2 * nominal, (turn, min(delays), max(delays))
    delays = [polls.after_turn(unit, unannounced=True, notified=True) for unit in units]
    assert all(3.75 <= d <= 5.0 for d in delays)  # work done: back to the poll interval, within it


def test_a_backlog_takes_small_batches_only_while_another_tenant_has_live_traffic() -> None:
    """``_shares``: a tenant whose last batch was full fetches ``SHARED_BATCH`` rows while some
    tenant's turn fetched fewer than its batch within ``LIVE_WINDOW``; full batches otherwise."""
    shares = BacklogShares()
    backlog, quiet = Tenantish(), Tenantish()
    assert shares.limit_for(backlog) is None
    shares.after_turn(backlog, fetched=1000, full=True)
    assert shares.limit_for(backlog) is None  # no live traffic yet: full batches
    shares.after_turn(quiet, fetched=1, full=False)
    assert shares.limit_for(backlog) == SHARED_BATCH
    assert shares.limit_for(quiet) is None  # live traffic keeps its batch
    shares.after_turn(backlog, fetched=SHARED_BATCH, full=True)
    assert shares.limit_for(backlog) == SHARED_BATCH  # still a backlog
    shares._live_at -= LIVE_WINDOW  # the live tenant fell quiet a window ago
    assert shares.limit_for(backlog) is None
    shares.after_turn(backlog, fetched=0, full=False)  # drained
    assert not backlog.backlogged
    assert BacklogShares(shared_batch=None).limit_for(Tenantish(backlogged=True)) is None


@pytest.mark.postgres
def test_a_step_with_a_limit_fetches_that_many_and_says_more_are_waiting(pg: sa.Engine) -> None:
    outbox = Outbox(pg, shards=2)
    outbox.create_tables()
    with outbox.begin() as session:
        for i in range(25):
            outbox.publish(session, "shares", {"i": i}, key=f"k{i % 5}")
    relay = Relay(outbox, InMemoryTransport(InMemoryBroker()), worker_id="w", batch_size=1000)
    try:
        step = relay._step
        first = step.run(limit=10)
        assert (first.batch.fetched, first.again) == (10, True)
        rest = step.run(limit=100)
        assert (rest.batch.fetched, rest.again) == (15, False)
    finally:
        relay.close()


def test_the_tail_of_a_drained_backlog_is_no_live_traffic() -> None:
    """A catch-up after an outage: every tenant has a backlog, so all take full batches. The last,
    partial batch of the first backlog to drain is no tenant's live traffic: it must not cut the
    other backlogs to ``SHARED_BATCH`` rows for ``LIVE_WINDOW``."""
    shares = BacklogShares()
    first, other = Tenantish(), Tenantish()
    for unit in (first, other):
        shares.after_turn(unit, fetched=1000, full=True)
    assert shares.limit_for(other) is None
    shares.after_turn(first, fetched=300, full=False)  # its backlog's tail
    assert not first.backlogged
    assert shares.limit_for(other) is None
    shares.after_turn(first, fetched=2, full=False)  # then live traffic
    assert shares.limit_for(other) == SHARED_BATCH


class WatchedCondition(threading.Condition):
    """``BacklogShares``' condition, telling the test when a turn waits on it and for how long at most."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []
        self.entered = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.entered.set()
        return super().wait(timeout)


def test_a_backlogs_shared_turn_waits_for_the_live_turns_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_shares``: while a live tenant's turn runs, a backlog's shared turn does not start; it
    starts when the live turn ends, or after ``YIELD_AT_MOST`` when live turns go on and on. A
    backlog's full turn (no live traffic) and a live turn never wait.

    The yield is 20 ms: a test thread stalled that long by a loaded host saw the backlog's turn
    start "while the live turn ran" (it had waited out its yield), and "let go when the live turn
    ended" was checked against 10 ms of wall time. So where the yield must not run out, it is a
    minute: only the live turn's end can let the backlog go, and a turn that waited would show by
    the minute. The turn that outlasts the yield keeps the real one; the waits its condition saw say
    it asked for no more."""
    from outbox.tenants import _shares

    shares = BacklogShares()
    condition = shares._running = WatchedCondition()
    backlog, quiet, other = Tenantish(backlogged=True), Tenantish(), Tenantish()
    started: list[float] = []

    def backlog_turn() -> None:
        with shares.turn(backlog, shared=True):
            started.append(time.monotonic())

    monkeypatch.setattr(_shares, "YIELD_AT_MOST", 60.0)
    with shares.turn(quiet, shared=False):
        with shares.turn(other, shared=False):  # a second live turn at once
            pass
        waiting = threading.Thread(target=backlog_turn, daemon=True)
        waiting.start()
        assert condition.entered.wait(10), "the shared turn did not wait for the live turn"
        assert not started  # held while the live turn runs
        ended = time.monotonic()
    waiting.join(30)
    assert started and started[0] - ended < 30, "not let go when the live turn ended"

    condition.waits.clear()
    with shares.turn(quiet, shared=False):  # live traffic running
        with shares.turn(backlog, shared=False):  # a full batch: no live traffic lately
            pass
        with shares.turn(other, shared=False):  # a live turn
            pass
    assert condition.waits == [], "a full batch or a live turn waited"

    monkeypatch.setattr(_shares, "YIELD_AT_MOST", YIELD_AT_MOST)
    waited: list[float] = []

    def outlasted() -> None:
        began = time.monotonic()
        with shares.turn(backlog, shared=True):
            waited.append(time.monotonic() - began)

    with shares.turn(quiet, shared=False):  # a live turn that outlasts the yield
        turn = threading.Thread(target=outlasted, daemon=True)
        turn.start()
        turn.join(30)
        assert waited, "the shared turn waited for as long as the live turn ran"
    assert waited[0] >= YIELD_AT_MOST * 0.9
    assert condition.waits and all(t is not None and t <= YIELD_AT_MOST for t in condition.waits)
