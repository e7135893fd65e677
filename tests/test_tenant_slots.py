"""A fleet's slots per server: a hung server's steps and writes hold half its workers and writers at most.

The fleet on real servers is ``test_tenant_hung``; here the bounds alone, with calls that block
as a statement on a hung server does.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from outbox.tenants._schedule import Schedule
from outbox.tenants._slots import ServerSlots
from outbox.tenants._units import FleetDatabase, Unit


def database(server: str) -> FleetDatabase:
    nothing: Any = None  # no engine, gate or outage: the slots look at the server alone
    return FleetDatabase(nothing, owned=False, outage=nothing, gate=nothing, server=("postgresql", server))


def test_a_hung_servers_writes_hold_half_the_writers_and_the_others_writes_run() -> None:
    slots = ServerSlots(4, Schedule())
    slots.span(2)
    writers = ThreadPoolExecutor(4)  # the fleet's shared writers
    hung, healthy = (slots.writer(database("hung"), writers, failed=lambda: None, every=1.0),
                     slots.writer(database("ok"), writers, failed=lambda: None, every=1.0))
    release = threading.Event()
    held = threading.Semaphore(0)

    def stuck() -> bool:
        held.release()
        return release.wait(30)

    def workers_writes() -> None:  # a worker's tenants' writes: a third one is written on the worker
        for _ in range(4):
            hung.submit(stuck)

    worker = threading.Thread(target=workers_writes, daemon=True)
    try:
        worker.start()
        assert all(held.acquire(timeout=5) for _ in range(3))  # two on writers, one on the worker
        assert not held.acquire(timeout=0.3)
        assert [healthy.submit(lambda: "written").result(timeout=5) for _ in range(4)] == ["written"] * 4
    finally:
        release.set()
        worker.join(10)
        writers.shutdown(wait=True)
    assert not worker.is_alive()


def test_a_step_without_a_slot_is_put_off_and_woken_when_one_is_given_back() -> None:
    schedule = Schedule()
    slots = ServerSlots(4, schedule)
    slots.span(2)
    hung, other = database("hung"), database("ok")
    step: Any = object()
    tenant: Any = None
    units = [Unit(tenant=tenant, db=hung, step=step) for _ in range(3)]
    assert slots.take(units[0]) and slots.take(units[1])
    assert slots.take(Unit(tenant=tenant, db=other, step=step))
    assert not slots.take(units[2])  # the server holds half the workers
    assert units[2].state == "idle"
    slots.give_back(units[0])
    assert units[2].state == "queued"  # woken, not left to its timer
    assert slots.take(units[2])
    slots.span(1)  # one server: it may take every worker
    assert slots.take(units[0]) and slots.take(Unit(tenant=tenant, db=hung, step=step))


def test_a_slot_given_back_wakes_a_tenant_still_waiting_not_one_served_since_or_removed() -> None:
    """A tenant put off and then served (woken by its timer or a notification while a slot was
    free), or removed, waits no more: the slot given back wakes the next tenant that does, not
    the one the wake-up would be lost on (that one waited for its ``SLOT_RETRY`` timer)."""
    schedule = Schedule()
    slots = ServerSlots(2, schedule)
    slots.span(2)  # one slot per server
    hung = database("hung")
    step: Any = object()
    tenant: Any = None
    a, x, y, gone, z = (Unit(tenant=tenant, db=hung, step=step) for _ in range(5))
    idle = a.state

    def put_off(unit: Unit) -> None:
        assert not slots.take(unit)
        unit.state = idle  # its worker ends the turn

    assert slots.take(a)
    put_off(x)
    put_off(y)
    slots.give_back(a)
    assert x.state == "queued"
    assert slots.take(y)  # woken by its timer before x ran: served, it waits no more
    put_off(x)
    slots.give_back(y)
    assert x.state == "queued"  # not y, served since
    assert slots.take(x)
    put_off(gone)
    put_off(z)
    gone.removed = True  # removed while it waited
    slots.give_back(x)
    assert z.state == "queued"
