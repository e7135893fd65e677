"""CPython's thread switch interval, tuned for a process whose threads serve many tenants at once;
and the fleet's producers' linger, which that interval would otherwise cut short.

In a ``TenantRelay`` the threads of one process share one interpreter lock:
a worker draining a tenant's backlog spends most of its time in Python
(decoding a fetch of 1,000 rows, building records, planning and writing their
outcomes), while a quiet tenant's message passes through many short holds of
the lock on other threads: the LISTEN thread that hears its commit, the worker
that takes it, each round trip of its fetch, its producer's delivery report.
A thread that wants the lock back after I/O waits until the holder gives it up,
and a thread busy in Python gives it up only once the switch interval has
passed since the request: CPython's default, 5 ms, at every step of the quiet
message's way. With a millisecond each such wait is bounded by a millisecond,
and the backlog pays a switch per millisecond, not per five, only while
another thread is waiting (docs/tenants.md, *The interpreter lock*). Not
shorter: at 0.2 ms the quiet tenant's p99 next to a 1,000,000-row backlog
was 12.1-14.3 ms against 14.3-16.7 ms at 1 ms (three rounds each,
alternating), but eight workers all busy (200,000 rows over 500 tenants)
sent 0.56-0.94x what one relay did, against 0.93-1.18x at 1 ms.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

FLEET_SWITCH_INTERVAL = 0.001
"""Seconds a thread busy in Python keeps the interpreter lock while another waits for it."""


def tune_switch_interval() -> None:
    """Hand the interpreter lock to a waiting thread after ``FLEET_SWITCH_INTERVAL`` (CPython: 5 ms).

    For a process that runs a ``TenantRelay``: ``outbox relay --tenants``
    calls it once the fleet is built. It changes an interpreter-wide setting, so a library never
    calls it on its own; a service embedding ``TenantRelay.run`` may call it
    as the command does.
    """
    sys.setswitchinterval(FLEET_SWITCH_INTERVAL)


FLEET_LINGER_MS = 100
"""librdkafka's ``linger.ms`` for a fleet's Kafka producers unless the settings name it (5 elsewhere).

``KafkaTransport.publish`` produces a batch's records, then waits with
``flush()``, during which librdkafka sends at once whatever it holds, whatever
the linger: the linger only decides whether a request leaves *while* the
records are still being produced. A single relay produces its batch (1,000 rows
in the benchmark) in a few milliseconds. A fleet's worker produces its 400
beside seven others, the lock switching every millisecond, and at 5 ms
librdkafka sent its batch in several small requests as it came: the two shared producers' threads took
0.7-1.8 CPU seconds a 200,000-row drain against 0.3 for the single relay.
With the linger past the produce loop they took 0.4-0.5 s, and the fleet
drained 15 % faster (docs/benchmarks.md, *A fleet's producers linger until the
flush*); no record waits for it, as the flush ends every publish.
"""


STICKY_LINGER_MS = 10
"""librdkafka's ``sticky.partitioning.linger.ms`` beside ``FLEET_LINGER_MS``: what it is at the
transport's 5 ms (twice the linger). Left to follow the linger, a fleet's unkeyed records, every
tenant's through the same shared producers, would stay on one partition 200 ms at a time."""


def fleet_kafka_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` for a fleet's ``KafkaTransport``: ``linger.ms`` at ``FLEET_LINGER_MS``, unless
    they set the linger or the message timeout, under any of their names.

    A message timeout no longer than the linger is refused by librdkafka, and one
    set turns the transport to waves (each wave flushed): the linger is then the
    settings' own. The sticky partitioning of unkeyed records keeps its 10 ms
    unless the settings name it.
    """
    from transports.kafka._settings import sets_property

    fleet = dict(settings)
    if sets_property(settings, "linger.ms") or sets_property(settings, "message.timeout.ms"):
        return fleet
    fleet["linger.ms"] = FLEET_LINGER_MS
    fleet.setdefault("sticky.partitioning.linger.ms", STICKY_LINGER_MS)  # it has no other name
    return fleet
